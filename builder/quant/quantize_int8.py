"""INT8 weights: symmetric, one scale per output channel, and the inverse.

Layout (the engine's `int8` layout; torch's `aten._weight_int8pack_mm` reads it as is):
    qweight int8 (N, K), scales float32 (N,);   w[n, k] = qweight[n, k] * scales[n]

Every scale is a bfloat16 value (stored as float32): the CPU's packed GEMM reads scales as
bfloat16, so a scale off that grid would be re-rounded at load by up to 2^-9 of itself, a
per-row error on top of the rounding the builder chose. Scales are rounded up, never down, so
no code leaves [-127, 127].
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from tritium.kernels.quant_layouts import dequantize_rowwise

from .param16 import param16, param16_dtype



def bf16_ceil(s: torch.Tensor) -> torch.Tensor:
    """The smallest bfloat16 value >= s, for positive finite float32 s, as float32 (clears the
    16 low mantissa bits, carrying into the bfloat16 part when any was set)."""
    bits = s.float().contiguous().view(torch.int32)
    return ((bits + 0xFFFF) & ~0xFFFF).view(torch.float32)


def int8_row_scales(w: torch.Tensor, qmax: int = 127) -> torch.Tensor:
    """Per-row scales (N,) of w (N, K): amax / qmax (127; 31 for int6 codes), rounded up to
    bfloat16 (see the module doc)."""
    return bf16_ceil((w.float().abs().amax(dim=1) / float(qmax)).clamp_min(1e-10))


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


# ---- group-wise int8 (LayerQuant.group_size set; kernels/quant_layouts.py INT8_GROUPED_LAYOUT) ----

def _groups(w: torch.Tensor, group_size: int) -> torch.Tensor:
    n, k = w.shape
    if group_size <= 0 or k % group_size:
        raise ValueError(f"group_size {group_size} must divide in_features {k}")
    return w.float().reshape(n, k // group_size, group_size)


def _pack_groups(c: torch.Tensor, s: torch.Tensor, z: Optional[torch.Tensor]):
    """codes (N, Gn, G), scales / zeros (N, Gn) -> qweight (N, K), scales / zeros (Gn, N)."""
    n = c.shape[0]
    return (c.reshape(n, -1), s.t().contiguous(), None if z is None else z.t().contiguous())


def quantize_int8_grouped(w: torch.Tensor, group_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Float weight (N, K) -> (qweight int8 (N, K), scales float16 (K // G, N)): symmetric,
    scale = amax / 127 of each group of `group_size` input channels of a row, rounded to 16 bits
    (param16.py) before the codes are chosen. Exact on a Q8_0 block (w = d q, d float16)."""
    wg = _groups(w, group_size)
    amax = wg.abs().amax(dim=2)
    s16 = param16(amax / 127.0, param16_dtype(amax / 127.0), positive=True)
    s = s16.float()
    c = torch.round(wg / s[:, :, None]).clamp_(-127, 127)
    q, scales, _ = _pack_groups(c.to(torch.int8), s16, None)
    return q, scales


def _asym_candidate(wg: torch.Tensor, levels: int, lo_code: int, hi_code: int, dtype: torch.dtype):
    """(codes, scale, zero) mapping each group's [min, max] onto codes [lo_code, hi_code]
    (levels = hi_code - lo_code): w = code * scale + zero, scale and zero rounded to `dtype`
    first. A group whose values lie on a grid min + d * j, j = 0..m, with `levels` a multiple of
    m, gets integer codes."""
    lo, hi = wg.amin(dim=2), wg.amax(dim=2)
    s = param16((hi - lo) / levels, dtype, positive=True).float()
    z = param16(lo - lo_code * s, dtype).float()
    c = torch.round((wg - z[:, :, None]) / s[:, :, None]).clamp_(-128, 127)
    return c, s, z


def _pick(cands, wg: torch.Tensor):
    """Per group, the candidate (codes, scale, zero) of least squared error."""
    best = None
    for c, s, z in cands:
        err = ((c * s[:, :, None] + z[:, :, None] - wg) ** 2).sum(dim=2)
        if best is None:
            best = [err, c, s, z]
            continue
        better = err < best[0]
        best[0] = torch.where(better, err, best[0])
        best[1] = torch.where(better[:, :, None], c, best[1])
        best[2] = torch.where(better, s, best[2])
        best[3] = torch.where(better, z, best[3])
    return best[1], best[2], best[3]


def quantize_int8_source_grid(w: torch.Tensor, group_size: int
                              ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric group-wise int8 that keeps a block-quantized source's grid:
    (qweight int8 (N, K), scales float16 (K // G, N), zeros float16 (K // G, N)).

    Per group the least-error of these (scale, zero) choices, each rounded to 16 bits before its
    codes are chosen (param16.py):
    - [min, max] onto codes 0..15, zero = min: a Q4_1 block (w = d * q + m, d and m float16,
      q = 0..15 spanning the block) is stored exactly (scale d, zero m);
    - symmetric amax / 8, zero 0: a Q4_0 block (w = d * (q - 8), amax = 8 |d|): scale |d|, exact;
    - symmetric amax / 127, zero 0: a Q8_0 block (w = d * q, amax at 127): scale d, exact;
    - [min, max] onto -128..127 (255 steps) and amax / 127: ordinary asymmetric / symmetric
      group-wise int8 for a group on no 4- or 8-bit grid."""
    wg = _groups(w, group_size)
    amax = wg.abs().amax(dim=2)
    lo, hi = wg.amin(dim=2), wg.amax(dim=2)
    dtype = param16_dtype(amax, lo, hi)
    zero = torch.zeros_like(amax)
    cands = [_asym_candidate(wg, 15, 0, 15, dtype), _asym_candidate(wg, 255, -128, 127, dtype)]
    for div in (127.0, 8.0):
        s = param16(amax / div, dtype, positive=True).float()
        cands.append((torch.round(wg / s[:, :, None]).clamp_(-127, 127), s, zero))
    c, s, z = _pick(cands, wg)
    return _pack_groups(c.to(torch.int8), s.to(dtype), z.to(dtype))


# ---- the int6 embedding / LM head (codes -32..31; kernels/quant_layouts.py INT6_LAYOUT) ----

INT6_CLIP_RATIOS = torch.linspace(0.6, 1.0, 41)  # scale candidates: ratio x amax / 31


def int6_scales(w: torch.Tensor, group_size=None) -> torch.Tensor:
    """Scales of the int6 grid for w (N, K), one per row (bfloat16 values, rounded up like
    int8_row_scales) or per group of `group_size` (float16, (K // G, N)): per row / group, the
    candidate ratio x amax / 31 (INT6_CLIP_RATIOS) whose round-to-nearest codes in -32..31 give
    the least squared weight error (a clip search: on a 6-bit grid the largest value alone
    should not set the step)."""
    n, k = w.shape
    wr = w.float() if group_size is None else _groups(w, group_size).reshape(-1, group_size)
    amax = wr.abs().amax(dim=1).clamp_min(1e-10)
    dtype = None if group_size is None else param16_dtype(amax / 31.0)  # float16 unless past its range
    best_err = best_s = None
    for r in INT6_CLIP_RATIOS.tolist():
        s = amax * r / 31.0
        s = bf16_ceil(s) if dtype is None else param16(s, dtype, positive=True)  # the stored values
        sf = s.float()
        err = ((torch.round(wr / sf[:, None]).clamp_(-32, 31) * sf[:, None] - wr) ** 2).sum(dim=1)
        better = err < best_err if best_err is not None else torch.ones_like(err, dtype=torch.bool)
        best_err = err if best_err is None else torch.where(better, err, best_err)
        best_s = s if best_s is None else torch.where(better, s, best_s)
    return best_s if group_size is None else best_s.view(n, k // group_size).t().contiguous()


def quantize_int6(w: torch.Tensor, group_size=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Round to nearest on int6_scales' grid: (codes int8 (N, K) in -32..31, scales: float32
    (N,) with bfloat16 values per row, or float16 (K // G, N) per group)."""
    s = int6_scales(w, group_size)
    full = s[:, None] if group_size is None else s.float().t().repeat_interleave(group_size, dim=1)
    return torch.round(w.float() / full).clamp_(-32, 31).to(torch.int8), s
