"""GPTQ (gptqmodel / AutoGPTQ) linears -> ImportedLinear.

Layout (gptqmodel's and AutoGPTQ's torch dequantization code, 4-bit, int32 words):
    qweight int32 (K/8, N)   packed along the input dim: nibble j of row r is input channel 8 r + j
    qzeros  int32 (K/G, N/8) packed along the output dim: nibble j of word c is output channel 8 c + j
    scales  fp16  (K/G, N)
    g_idx   int32 (K,)       the group of each input channel (act-order permutes it)
    w[n, k] = scales[g, n] * (q[n, k] - z[g, n]),  g = g_idx[k]
checkpoint_format "gptq" (v1) stores z - 1; gptqmodel converts on load by adding 0x11111111 to
each int32 word of qzeros (one per nibble, carries included), which is what is done here, so a
v1 file decodes exactly as the library decodes it. "gptq_v2" stores z.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..convert import CheckpointError
from .linear import ImportedLinear, int4_from_codes
from .spec import WeightScheme

_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int64)


def unpack_rows(words: torch.Tensor) -> torch.Tensor:
    """int32 (R, C) -> (8 R, C): nibble j of row r becomes row 8 r + j."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    return ((w[:, None, :] >> _SHIFTS[None, :, None]) & 0xF).reshape(-1, words.shape[1])


def unpack_cols(words: torch.Tensor) -> torch.Tensor:
    """int32 (R, C) -> (R, 8 C): nibble j of column c becomes column 8 c + j."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    return ((w[:, :, None] >> _SHIFTS) & 0xF).reshape(words.shape[0], -1)


def read_linear(get: Callable, has: Callable, prefix: str, scheme: WeightScheme, v1_zeros: bool) -> ImportedLinear:
    qweight, qzeros, scales = get(prefix + ".qweight"), get(prefix + ".qzeros"), get(prefix + ".scales")
    for name, t in (("qweight", qweight), ("qzeros", qzeros)):
        if t.dtype != torch.int32:
            raise CheckpointError(f"{prefix}.{name}: dtype {t.dtype}, expected torch.int32")
    n = qweight.shape[1]
    if scales.shape[1] != n or qzeros.shape != (scales.shape[0], (n + 7) // 8):
        raise CheckpointError(f"{prefix}: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)} and scales "
                              f"{tuple(scales.shape)} do not fit the GPTQ 4-bit layout")
    codes = unpack_rows(qweight).t().contiguous()                 # (N, K)
    if v1_zeros:
        qzeros = ((qzeros.to(torch.int64) & 0xFFFFFFFF) + 0x11111111) & 0xFFFFFFFF
    z = unpack_cols(qzeros)[:, :n]                                   # (K/G, N)
    g_idx = get(prefix + ".g_idx") if has(prefix + ".g_idx") else None
    group_size = scheme.group_size
    if group_size is None:
        if scales.shape[0] != 1:
            raise CheckpointError(f"{prefix}.scales: {scales.shape[0]} groups but group_size is -1")
        g_idx = None
    return int4_from_codes(codes.to(torch.uint8), scales, z, group_size, g_idx, prefix)
