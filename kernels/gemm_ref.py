"""Torch references of the quantized GEMMs (y = x W^T + b), on the builder's packed layouts.

Layouts: tritium.kernels.quant_layouts. The W8A8 fp8 path also quantizes activations per token
to E4M3 with scale = amax / 448.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from .quant_layouts import dequantize_grouped, dequantize_int4, dequantize_rowwise

FP8_E4M3_MAX = 448.0
# Floor of a per-token amax, so an all-zero row gets a finite scale (and quantizes to zeros).
FP8_MIN_AMAX = 1e-12


def w4a16_gemm_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                   group_size: int, g_idx: Optional[torch.Tensor] = None,
                   bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x (..., K) @ dequant(int4)^T (+ bias) in x's dtype (zeros None: the symmetric layout)."""
    w = dequantize_int4(qweight, scales, zeros, group_size, g_idx, x.dtype)
    return F.linear(x, w, bias)


def w8a16_gemm_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                   bias: Optional[torch.Tensor] = None, zeros: Optional[torch.Tensor] = None,
                   group_size: Optional[int] = None) -> torch.Tensor:
    """Weight-only int8 (or fp8) GEMM: x @ (q * scales[:, None])^T (+ bias) in x's dtype; with
    group_size, the grouped layout x @ (q * scales[g, n] + zeros[g, n])^T."""
    if group_size:
        w = dequantize_grouped(qweight, scales, zeros, group_size, x.dtype)
    else:
        w = dequantize_rowwise(qweight, scales, x.dtype)
    return F.linear(x, w, bias)


def quantize_fp8_per_token_ref(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> (x_q float8_e4m3fn (M, K), scale float32 (M,)); scale = amax / 448 per row."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1).clamp(min=FP8_MIN_AMAX) / FP8_E4M3_MAX
    xq = (xf / scale[:, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return xq, scale


def fp8_gemm_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """FP8 W8A8: quantize x per token, y = (x_q @ w_q^T) * x_scale[m] * w_scale[n] (+ bias)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    xq, xs = quantize_fp8_per_token_ref(x2)
    y = (xq.float() @ qweight.float().t()) * xs[:, None] * scales.float()[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*shape[:-1], qweight.shape[0])
