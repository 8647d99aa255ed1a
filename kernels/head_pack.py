"""The int6 LM head's weight layout for its integer-dot kernel (kernels/cpu_head.c), made once at
load from the int6 embedding's codes and scales (quant_layouts.INT6_LAYOUT), and the torch
reference of the W6A8 product written from the definition (tests compare the kernel with it).

Layout (Head6Weight), K a multiple of 32, vocabulary rows (output channels) in panels of 16
(P = ceil(N / 16), the last panel padded with code -32 and scale 0), per channel n:
    codes  uint8 (P, K/32, 6, 16, 4)  u = c + 32 in 0..63 of channel 16 p + j; [p, b, v, j, e]:
           v = 0..3: low nibble u & 15 at k = 32 b + 4 v + e, high nibble at that k + 16;
           v = 4, 5: bits 2 t, 2 t + 1 hold u >> 4 at k = 32 b + 4 (4 (v - 4) + t) + e
           (6 bits per weight, as the engine stores them)
    d      float16 (P, K/G, 16)   the scale of each group of G inputs, G a multiple of 32
           (per-row scales: G = K)
    r      float32 (N,)           a power of two per channel, so d keeps float16's precision
    w[n, k] = r[n] c[n, k] d[n, k // G]
The engine's float16 group scales carry over exactly (r only moves exponents); per-row bfloat16
scales are float16 values after the division by r. The lookup of input tokens reads the same
codes (rows(), tritium_head6_rows), so the model holds one copy of the matrix.

Activations: i8dot_pack.quantize_q8_ref (per row and block of 32, int8, float32 scale).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .i8dot_pack import PANEL, QBLOCK, quantize_q8_ref


@dataclass
class Head6Weight:
    codes: torch.Tensor
    d: torch.Tensor
    r: torch.Tensor
    group_size: int

    @property
    def shape(self) -> Tuple[int, int]:
        return self.r.shape[0], self.codes.shape[1] * QBLOCK


def repackable(k: int, group_size: Optional[int]) -> bool:
    """Shapes the kernel takes: K a multiple of 32, groups (if any) a multiple of 32 dividing K."""
    return k % QBLOCK == 0 and (group_size is None or (group_size % QBLOCK == 0 and k % group_size == 0))


def _panels(t: torch.Tensor, fill: int = 0) -> torch.Tensor:
    """(N, ...) -> (P, 16, ...), the last panel padded with `fill`."""
    n = t.shape[0]
    p = (n + PANEL - 1) // PANEL
    pad = torch.full((p * PANEL - n,) + tuple(t.shape[1:]), fill, dtype=t.dtype)
    return torch.cat((t, pad)).view((p, PANEL) + tuple(t.shape[1:]))


def repack6(codes: torch.Tensor, scales: torch.Tensor, group_size: Optional[int]) -> Head6Weight:
    """Signed codes c (N, K) in -32..31 and scales per row (N,) or per group (K // G, N),
    w = c s -> Head6Weight."""
    n, k = codes.shape
    if not repackable(k, group_size):
        raise ValueError(f"head6 repack: K={k} and group_size={group_size} must be multiples of {QBLOCK}")
    c = codes.to(torch.int32)
    if bool(((c < -32) | (c > 31)).any()):
        raise ValueError("head6 repack: int6 codes must lie in [-32, 31]")
    g = group_size or k
    if group_size is None:
        if scales.shape != (n,):
            raise ValueError(f"head6 repack: per-row scales must be ({n},), got {tuple(scales.shape)}")
        s = scales.float()[:, None]
    else:
        if scales.shape != (k // g, n):
            raise ValueError(f"head6 repack: group scales must be ({k // g}, {n}), got {tuple(scales.shape)}")
        s = scales.float().t()
    amax = s.abs().amax(dim=1)
    _, e = torch.frexp(torch.where(amax > 0, amax, torch.ones_like(amax)))
    r = torch.ldexp(torch.ones_like(amax), e)  # as i8dot_pack.repack: amax / r in [0.5, 1)
    d16 = _panels((s / r[:, None]).to(torch.float16)).permute(0, 2, 1).contiguous()  # (P, K/G, 16)
    kb = k // QBLOCK
    u = (c + 32).view(n, kb, 8, 4)  # slice i = k 4 i .. 4 i + 3 of each block
    lo, hi = u & 15, u >> 4
    nib = lo[:, :, :4] | (lo[:, :, 4:] << 4)  # (N, KB, 4, 4)
    h = torch.stack([sum(hi[:, :, 4 * v + t] << (2 * t) for t in range(4)) for v in range(2)], dim=2)
    b = torch.cat((nib, h), dim=2).to(torch.uint8)  # (N, KB, 6, 4)
    codes_p = _panels(b).permute(0, 2, 3, 1, 4).contiguous()  # (P, KB, 6, 16, 4)
    return Head6Weight(codes_p, d16, r.float().contiguous(), g)


def signed_codes(p: Head6Weight, ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The signed codes (N, K) int8 of the repacked head, or of the rows `ids` only (T, K)."""
    n, k = p.shape
    kb = k // QBLOCK
    rows = torch.arange(n) if ids is None else ids.long()
    b = p.codes[rows // PANEL, :, :, rows % PANEL, :].to(torch.int32)  # (T, KB, 6, 4)
    nib, h = b[:, :, :4], b[:, :, 4:]
    lo = torch.cat((nib & 15, nib >> 4), dim=2)  # slices 0..7
    hi = torch.cat([(h >> (2 * t)) & 3 for t in range(4)], dim=3).reshape(-1, kb, 8, 4)  # slice 4 v + t
    return ((lo | (hi << 4)) - 32).to(torch.int8).reshape(-1, k)


# i8dot_codes: at most this many ids gather their rows one by one (about 2x faster than the
# advanced-indexing gather for one row; slower from about 5)
LOOKUP_LOOP_MAX = 4


def i8dot_codes(p, ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The signed int8 codes (N, K) of an 8-bit i8dot_pack.I8DotWeight, or of the rows `ids`
    (T, K): the lookup of an int8 head that holds its codes in the integer-dot panels."""
    n, k = p.shape
    if p.bits != 8:
        raise ValueError(f"i8dot_codes: 8-bit panels only, got {p.bits}")
    if ids is not None and ids.numel() <= LOOKUP_LOOP_MAX:  # a decode step's few rows: basic indexing
        idl = ids.reshape(-1).tolist()
        if idl and (min(idl) < 0 or max(idl) >= n):
            raise IndexError(f"i8dot_codes: ids must lie in [0, {n})")
        if not idl:
            return torch.empty(0, k, dtype=torch.int8)
        parts = [p.codes[i // PANEL, :, :, i % PANEL, :] for i in idl]
        b = parts[0].unsqueeze(0) if len(parts) == 1 else torch.stack(parts)
        return b.reshape(-1, k).view(torch.int8)
    rows = torch.arange(n) if ids is None else ids.long()
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= n):
        raise IndexError(f"i8dot_codes: ids must lie in [0, {n})")
    b = p.codes[rows // PANEL, :, :, rows % PANEL, :]  # (T, K/32, 8, 4): k = 32 b + 4 i + e
    return b.reshape(-1, k).view(torch.int8)


def scales(p: Head6Weight) -> torch.Tensor:
    """w's scale per channel and group, float32 (N, K // G): r d (exact)."""
    n = p.shape[0]
    return p.d.permute(0, 2, 1).reshape(-1, p.d.shape[1])[:n].float() * p.r[:, None]


def dequantize(p: Head6Weight, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    n, k = p.shape
    c = signed_codes(p).to(torch.float64).view(n, k // p.group_size, p.group_size)
    return (c * scales(p).double()[:, :, None]).reshape(n, k).to(dtype)


def head6_gemm_ref(x: torch.Tensor, p: Head6Weight) -> torch.Tensor:
    """The W6A8 product from the definition: activations quantized per 32-block (quantize_q8_ref),
    each block's exact integer dot times both blocks' scales, summed; float64 (M, N)."""
    m, k = x.shape
    n = p.shape[0]
    q, xd = quantize_q8_ref(x)
    qb = q.to(torch.int64).view(m, k // QBLOCK, QBLOCK)
    c = signed_codes(p).to(torch.int64).view(n, k // QBLOCK, QBLOCK)
    t = torch.einsum("mbi,nbi->mnb", qb, c).double()
    wd = scales(p).double().repeat_interleave(p.group_size // QBLOCK, dim=1)  # (N, K/32)
    return (t * xd.double()[:, None, :] * wd[None, :, :]).sum(dim=2)
