"""INT8 weights: symmetric, one scale per output channel, and the inverse.

Layout (the engine's `int8` layout; torch's `aten._weight_int8pack_mm` reads it as is):
    qweight int8 (N, K), scales float32 (N,);   w[n, k] = qweight[n, k] * scales[n]

Every scale is a bfloat16 value (stored as float32): the CPU's packed GEMM reads scales as
bfloat16, so a scale off that grid would be re-rounded at load by up to 2^-9 of itself, a
per-row error on top of the rounding the builder chose. Scales are rounded up, never down, so
no code leaves [-127, 127].
"""
from __future__ import annotations

from typing import Tuple

import torch

from tritium.kernels.quant_layouts import dequantize_rowwise



def bf16_ceil(s: torch.Tensor) -> torch.Tensor:
    """The smallest bfloat16 value >= s, for positive finite float32 s, as float32 (clears the
    16 low mantissa bits, carrying into the bfloat16 part when any was set)."""
    bits = s.float().contiguous().view(torch.int32)
    return ((bits + 0xFFFF) & ~0xFFFF).view(torch.float32)


def int8_row_scales(w: torch.Tensor) -> torch.Tensor:
    """Per-row scales (N,) of w (N, K): amax / 127, rounded up to bfloat16 (see the module doc)."""
    return bf16_ceil((w.float().abs().amax(dim=1) / 127.0).clamp_min(1e-10))


def int8_codes(w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest codes of w (N, K) on the grid scales[:, None] * [-127, 127], as float32."""
    return torch.round(w.float() / scales[:, None]).clamp_(-127, 127)


def quantize_int8(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Float weight (N, K) -> (qweight int8 (N, K), scales float32 (N,)), scale = amax / 127
    rounded up to bfloat16."""
    scales = int8_row_scales(w)
    return int8_codes(w, scales).to(torch.int8), scales


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of quantize_int8: float weight (N, K)."""
    return dequantize_rowwise(qweight, scales, dtype)
