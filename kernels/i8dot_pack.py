"""The integer-dot kernels' weight layout (kernels/cpu_gemm_i8dot.c), made once at load from a
quantized linear's dequantization-exact view, and the torch references of the W8A8 / W4A8
GEMM written from the definition (tests compare the native kernel with them).

Layout (I8DotWeight), K a multiple of 32, per output channel n and block b of 32 inputs:
    codes  uint8 (N, K)    int8 weights: u = c + 128 (c the signed code)
           uint8 (N, K/2)  int4 weights: u = c + 8 in 0..15, byte j of a block = k j (low nibble)
                           and k j + 16 (high nibble)
    d      float16 (N, K/32) block scale, z float16 (N, K/32) block zero (None: symmetric, 0)
    r      float32 (N,)      a power of two per channel, so d and z use float16's precision
    w[n, k] = r[n] (c[n, k] d[n, b] + z[n, b]),  b = k // 32

The source view (repack's arguments): signed codes c (N, K) and scales / zeros per output
channel (N,) or per group (K // G, N), G a multiple of 32, with w = c s + z: the int8 layout
as stored (c = qweight), the int4 layout with c = q - 8 (quant_layouts.py). Whatever width the
engine stores its scales in, the values are read through this one function.

Activations (quantize_q8_ref): per row, per block of 32, d = amax / 127, q = round half to even of
x * (127 / amax) (0 where amax = 0), in float32; x is first rounded to bfloat16 (the kernel's input).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

QBLOCK = 32


@dataclass
class I8DotWeight:
    codes: torch.Tensor
    d: torch.Tensor
    z: Optional[torch.Tensor]
    r: torch.Tensor
    bits: int  # 8 or 4

    @property
    def shape(self) -> Tuple[int, int]:
        return self.d.shape[0], self.d.shape[1] * QBLOCK


def _per_block(p: torch.Tensor, n: int, k: int, group_size: Optional[int]) -> torch.Tensor:
    """Scales or zeros (N,) or (K // G, N) -> float32 (N, K // 32)."""
    p = p.float()
    if group_size is None:
        if p.shape != (n,):
            raise ValueError(f"i8dot repack: per-channel parameters must be ({n},), got {tuple(p.shape)}")
        return p[:, None].expand(n, k // QBLOCK).contiguous()
    if p.shape != (k // group_size, n):
        raise ValueError(f"i8dot repack: group parameters must be ({k // group_size}, {n}), got {tuple(p.shape)}")
    return p.t().repeat_interleave(group_size // QBLOCK, dim=1).contiguous()


def repackable(k: int, group_size: Optional[int]) -> bool:
    """Shapes the kernels take: K a multiple of 32, groups (if any) a multiple of 32."""
    return k % QBLOCK == 0 and (group_size is None or (group_size % QBLOCK == 0 and k % group_size == 0))


def repack(codes: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor], group_size: Optional[int],
           bits: int) -> I8DotWeight:
    """The one repack: signed codes c (N, K) (int8: -128..127, int4: -8..7), scales / zeros per
    channel (N,) or per group (K // G, N), w = c s + z -> I8DotWeight."""
    if bits not in (8, 4):
        raise ValueError(f"i8dot repack: bits must be 8 or 4, got {bits}")
    n, k = codes.shape
    if not repackable(k, group_size):
        raise ValueError(f"i8dot repack: K={k} and group_size={group_size} must be multiples of {QBLOCK}")
    c = codes.to(torch.int32)
    lo, hi = (-128, 127) if bits == 8 else (-8, 7)
    if bool(((c < lo) | (c > hi)).any()):
        raise ValueError(f"i8dot repack: int{bits} codes must lie in [{lo}, {hi}]")
    s = _per_block(scales, n, k, group_size)
    z = _per_block(zeros, n, k, group_size) if zeros is not None else None
    if z is not None and not bool(z.any()):
        z = None
    amax = s.abs().amax(dim=1)
    if z is not None:
        amax = torch.maximum(amax, z.abs().amax(dim=1))
    _, e = torch.frexp(torch.where(amax > 0, amax, torch.ones_like(amax)))
    r = torch.ldexp(torch.ones_like(amax), e)  # amax / r in [0.5, 1): float16's normal range below
    d16 = (s / r[:, None]).to(torch.float16).contiguous()
    z16 = (z / r[:, None]).to(torch.float16).contiguous() if z is not None else None
    if bits == 8:
        u = (c + 128).to(torch.uint8).contiguous()
    else:
        u = (c + 8).to(torch.uint8).view(n, k // QBLOCK, 2, QBLOCK // 2)
        u = (u[:, :, 0] | (u[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
    return I8DotWeight(u, d16, z16, r.float().contiguous(), bits)


def signed_codes(p: I8DotWeight) -> torch.Tensor:
    """The signed codes c (N, K) int32 of a repacked weight (the inverse of repack's packing)."""
    n, k = p.shape
    if p.bits == 8:
        return p.codes.to(torch.int32) - 128
    b = p.codes.view(n, k // QBLOCK, QBLOCK // 2)
    u = torch.stack((b & 0x0F, b >> 4), dim=2).reshape(n, k)
    return u.to(torch.int32) - 8


def dequantize(p: I8DotWeight, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """w (N, K) = r (c d + z) of a repacked weight, in `dtype` (float64: exact)."""
    n, k = p.shape
    c = signed_codes(p).to(torch.float64).view(n, k // QBLOCK, QBLOCK)
    w = c * p.d.double()[:, :, None]
    if p.z is not None:
        w = w + p.z.double()[:, :, None]
    return (w.reshape(n, k) * p.r.double()[:, None]).to(dtype)


def quantize_q8_ref(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> (codes int8 (M, K), scales float32 (M, K // 32)): per row and block of 32,
    d = amax / 127, q = round(x * (127 / amax)), half to even, all in float32."""
    m, k = x.shape
    xb = x.to(torch.bfloat16).float().view(m, k // QBLOCK, QBLOCK)
    amax = xb.abs().amax(dim=2)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    q = torch.round(xb * inv[:, :, None]).clamp(-127, 127)
    return q.to(torch.int8).view(m, k), amax / 127.0


def i8dot_gemm_ref(x: torch.Tensor, p: I8DotWeight) -> torch.Tensor:
    """The W8A8 / W4A8 product from the definition: activations quantized per 32-block
    (quantize_q8_ref), the integer dot of each block, rescaled by both blocks' scales and summed,
    plus each block's zero times its activation sum; float64 (M, N)."""
    m, k = x.shape
    n = p.shape[0]
    q, xd = quantize_q8_ref(x)
    qb = q.to(torch.int64).view(m, k // QBLOCK, QBLOCK)
    c = signed_codes(p).to(torch.int64).view(n, k // QBLOCK, QBLOCK)
    t = torch.einsum("mbi,nbi->mnb", qb, c).double()  # exact integer block dots
    y = (t * xd.double()[:, None, :] * p.d.double()[None, :, :]).sum(dim=2)
    if p.z is not None:
        s = qb.sum(dim=2).double() * xd.double()  # (M, B): each block's activation sum
        y = y + s @ p.z.double().t()
    return y * p.r.double()[None, :]
