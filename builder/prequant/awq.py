"""AWQ (AutoAWQ, version "gemm") linears -> ImportedLinear.

Layout (AutoAWQ's WQLinear_GEMM.from_linear and awq.utils.packing_utils.dequantize_gemm):
    qweight int32 (K, N/8)   packed along the output dim with AWQ's interleave: nibble i of word c
                             holds output channel 8 c + AWQ_ORDER[i], AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
    qzeros  int32 (K/G, N/8) the zero points, packed the same way
    scales  fp16  (K/G, N)
    w[n, k] = (q[n, k] - z[g, n]) * scales[g, n],   g = k // G
"""
from __future__ import annotations

from typing import Callable

import torch

from ..convert import CheckpointError
from .gptq import unpack_cols
from .linear import ImportedLinear, int4_from_codes
from .spec import WeightScheme

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Columns of an unpacked AWQ tensor (R, 8 C) back into output-channel order."""
    inverse = [AWQ_ORDER.index(j) for j in range(8)]   # position holding channel j within a word
    idx = (torch.arange(x.shape[1] // 8)[:, None] * 8 + torch.tensor(inverse)[None, :]).reshape(-1)
    return x[:, idx]


def read_linear(get: Callable, has: Callable, prefix: str, scheme: WeightScheme) -> ImportedLinear:
    qweight, qzeros, scales = get(prefix + ".qweight"), get(prefix + ".qzeros"), get(prefix + ".scales")
    for name, t in (("qweight", qweight), ("qzeros", qzeros)):
        if t.dtype != torch.int32:
            raise CheckpointError(f"{prefix}.{name}: dtype {t.dtype}, expected torch.int32")
    n = qweight.shape[1] * 8
    if scales.shape[1] != n or qzeros.shape != (scales.shape[0], n // 8):
        raise CheckpointError(f"{prefix}: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)} and scales "
                              f"{tuple(scales.shape)} do not fit AWQ's GEMM layout")
    codes = _deinterleave(unpack_cols(qweight)).t().contiguous()   # (N, K)
    z = _deinterleave(unpack_cols(qzeros))                         # (K/G, N)
    group_size = scheme.group_size
    if group_size is None and scales.shape[0] != 1:
        raise CheckpointError(f"{prefix}.scales: {scales.shape[0]} groups but group_size is -1")
    return int4_from_codes(codes.to(torch.uint8), scales, z, group_size, None, prefix)
