"""16-bit storage of group scales and zero points (engine format 3).

A group of 32 int8 codes costs 256 bits; a float32 scale and zero point add 64 more (10 bits per
weight), a 16-bit scale alone 16 (8.5 bits per weight, llama.cpp's Q8_0). Scales and zeros are
therefore stored as float16, whose 11-bit significand holds the parameters of every GGUF block
type exactly (Q4_0 / Q4_1 / Q8_0 store their d and m as float16), so a source grid stays exact.
A tensor whose values leave float16's range (|x| > 65504) is stored as bfloat16 instead (8-bit
significand, float32's range). The runtime widens either to float32 where a kernel needs it.

Every quantizer rounds its parameters with `param16` *before* it picks codes, so the codes are
the nearest ones on the grid the engine will actually hold.
"""
from __future__ import annotations

from typing import Optional

import torch

FP16_MAX = 65504.0


def param16_dtype(*tensors: Optional[torch.Tensor]) -> torch.dtype:
    """float16 unless some value of the given tensors overflows it; then bfloat16."""
    for t in tensors:
        if t is not None and t.numel() and float(t.float().abs().max()) > FP16_MAX:
            return torch.bfloat16
    return torch.float16


def param16(t: Optional[torch.Tensor], dtype: torch.dtype, positive: bool = False) -> Optional[torch.Tensor]:
    """t rounded to `dtype` (float16 / bfloat16); positive=True (scales) keeps every value above
    zero (at least the dtype's smallest subnormal) so that w / scale stays finite."""
    if t is None:
        return None
    r = t.float().to(dtype)
    if positive:
        tiny = torch.tensor(2.0 ** -24 if dtype == torch.float16 else 2.0 ** -133, dtype=dtype)
        r = torch.maximum(r, tiny)
    return r


def bf16_exact(s: torch.Tensor) -> bool:
    """Whether every value of s is a bfloat16 value (then it is stored as bfloat16 losslessly)."""
    return bool(torch.equal(s.float().to(torch.bfloat16).float(), s.float()))


def compact_scales(s: torch.Tensor) -> torch.Tensor:
    """Per-row int8 scales as stored: bfloat16 when that is exact (quantize_int8's scales are
    bfloat16 values by construction), else float32 unchanged."""
    return s.to(torch.bfloat16) if s.dtype == torch.float32 and bf16_exact(s) else s
