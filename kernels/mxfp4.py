"""MXFP4 (OCP Microscaling Formats (MX) v1.0): the layout of gpt-oss's published expert weights.

Blocks of 32 consecutive input channels share one E8M0 scale (a power of two, 2^(byte - 127));
each value is an FP4 E2M1 code (1 sign, 2 exponent, 1 mantissa bit; exponent bias 1):
    code bits s e1 e0 m:  |x| = m / 2                 when e == 0 (subnormal: 0, 0.5)
                          |x| = 2^(e - 1) (1 + m / 2) when e > 0  (1, 1.5, 2, 3, 4, 6)
Engine layout of a (N, K) matrix (stacked on a leading expert dim for MoE experts):
    qweight uint8 (N, K // 2)   two codes per byte: low nibble = even k, high nibble = odd k
    scales  uint8 (N, K // 32)  the E8M0 exponent byte of block k // 32
    w[n, k] = e2m1(code[n, k]) * 2^(scales[n, k // 32] - 127)
This is Hugging Face's `*_blocks` (N, K // 32, 16) / `*_scales` (N, K // 32) with the block dim
flattened, so a checkpoint is imported byte for byte. The product is exact in float32 (and in
bfloat16 for scales within its exponent range): dequantizing adds no rounding.
"""
from __future__ import annotations

import torch

MXFP4_BLOCK = 32
MXFP4_LAYOUT = ("qweight uint8 (N, K//2): E2M1 codes, low nibble = even k, high nibble = odd k; "
                "scales uint8 (N, K//32): E8M0 exponents; w[n,k] = e2m1(code) * 2^(scales[n, k//32] - 127)")


def e2m1_values(dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """The 16 E2M1 code values, from the format's definition (sign, exponent, mantissa bits)."""
    codes = torch.arange(16, device=device)
    sign = 1.0 - 2.0 * (codes >> 3).float()
    exp, man = ((codes >> 1) & 3).float(), (codes & 1).float()
    mag = torch.where(exp == 0, man * 0.5, torch.exp2(exp - 1) * (1 + man * 0.5))
    return (sign * mag).to(dtype)


def dequantize_mxfp4(qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(..., N, K // 2) codes and (..., N, K // 32) exponents -> (..., N, K) weights in `dtype`."""
    lut = e2m1_values(torch.float32, qweight.device)
    q = qweight.to(torch.int64)
    vals = torch.stack([lut[q & 0xF], lut[q >> 4]], dim=-1).flatten(-2)  # (..., N, K)
    k = vals.shape[-1]
    exp = scales.to(torch.int32) - 127
    w = vals.view(*vals.shape[:-1], k // MXFP4_BLOCK, MXFP4_BLOCK) * torch.exp2(exp.float()).unsqueeze(-1)
    return w.view(*vals.shape).to(dtype)


def mxfp4_from_hf(blocks: torch.Tensor, scales: torch.Tensor):
    """Hugging Face's (…, N, K // 32, 16) blocks and (…, N, K // 32) scales -> the engine's
    (qweight (…, N, K // 2), scales (…, N, K // 32)), the same bytes."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"mxfp4 blocks/scales must be uint8, got {blocks.dtype} / {scales.dtype}")
    if tuple(blocks.shape[:-1]) != tuple(scales.shape) or blocks.shape[-1] != MXFP4_BLOCK // 2:
        raise ValueError(f"mxfp4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
                         f"(expected blocks = scales shape + ({MXFP4_BLOCK // 2},))")
    return blocks.reshape(*blocks.shape[:-2], -1).contiguous(), scales.contiguous()
