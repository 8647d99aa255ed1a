"""FP8 (E4M3) weights with one float32 scale per output channel, and the inverse.

Layout (the engine's `fp8` layout):
    qweight float8_e4m3fn (N, K), scales float32 (N,);   w[n, k] = float(qweight[n, k]) * scales[n]
The scale maps each row's amax onto E4M3's largest finite value (448).
"""
from __future__ import annotations

from typing import Tuple

import torch

from tritium.kernels.quant_layouts import dequantize_rowwise

FP8_E4M3_MAX = 448.0


def has_float8() -> bool:
    """Whether this torch build has the float8_e4m3fn dtype."""
    return hasattr(torch, "float8_e4m3fn")


def fp8_scales(w: torch.Tensor) -> torch.Tensor:
    """Per-output-channel scales (N,) float32 that map each row's amax of w (N, K) onto 448."""
    return (w.float().abs().amax(dim=1) / FP8_E4M3_MAX).clamp_min(1e-12)


def round_fp8(x: torch.Tensor) -> torch.Tensor:
    """Nearest E4M3 value (round half to even, saturating at +-448), as float32."""
    return x.float().clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).float()


def quantize_fp8(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Float weight (N, K) -> (qweight float8_e4m3fn (N, K), scales float32 (N,)), by rounding
    each w / scale to the nearest E4M3 value."""
    if not has_float8():
        raise ValueError("quantization 'fp8' needs a torch build with float8_e4m3fn")
    scales = fp8_scales(w)
    q = (w.float() / scales[:, None]).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scales


def dequantize_fp8(qweight: torch.Tensor, scales: torch.Tensor,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of quantize_fp8: float weight (N, K)."""
    return dequantize_rowwise(qweight, scales, dtype)
