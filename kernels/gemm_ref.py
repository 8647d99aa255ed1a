"""Torch references of the quantized GEMMs (y = x W^T + b), on the builder's packed layouts.

Layouts (written by the quantization helper, tritium.backend.quant):
    int4: qweight uint8 (N, K//2), low nibble = even k, high nibble = odd k, values q in 0..15;
          scales, zeros float32 (K//G, N); w[n, k] = (q[n, k] - 8) * scales[g, n] + zeros[g, n]
          with g = k // G, or g = g_idx[k] (int32 (K,), GPTQ act-order) when g_idx is given.
    int8: qweight int8 (N, K), scales float32 (N,): w = q * scales[n].
    fp8:  qweight float8_e4m3fn (N, K), scales float32 (N,): w = q * scales[n]. The W8A8 path also
          quantizes activations per token to E4M3 with scale = amax / 448.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

FP8_E4M3_MAX = 448.0
# Floor of a per-token amax, so an all-zero row gets a finite scale (and quantizes to zeros).
FP8_MIN_AMAX = 1e-12


def unpack_int4_ref(qweight: torch.Tensor) -> torch.Tensor:
    """uint8 (N, K//2) -> int32 (N, K) values 0..15 (low nibble first)."""
    lo = (qweight & 0xF).to(torch.int32)
    hi = (qweight >> 4).to(torch.int32)
    return torch.stack([lo, hi], dim=-1).reshape(qweight.shape[0], -1)


def dequantize_w4_ref(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                      g_idx: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Float32 (N, K) weight of the packed int4 layout."""
    q = unpack_int4_ref(qweight).float()
    k = q.shape[1]
    g = g_idx.long() if g_idx is not None else torch.arange(k, device=q.device) // group_size
    return (q - 8.0) * scales[g].t() + zeros[g].t()


def w4a16_gemm_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                   group_size: int, g_idx: Optional[torch.Tensor] = None,
                   bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x (..., K) @ dequant(int4)^T (+ bias) in x's dtype."""
    w = dequantize_w4_ref(qweight, scales, zeros, group_size, g_idx).to(x.dtype)
    return F.linear(x, w, bias)


def w8a16_gemm_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                   bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Weight-only int8 (or fp8) GEMM: x @ (q * scales[:, None])^T (+ bias) in x's dtype."""
    w = (qweight.float() * scales.float()[:, None]).to(x.dtype)
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
