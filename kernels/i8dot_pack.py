"""The integer-dot kernels' weight layout (kernels/cpu_gemm_i8dot.c), made once at load from a
quantized linear's dequantization-exact view, and the torch references of the W8A8 / W4A8
GEMM written from the definition (tests compare the native kernel with them).

Layout (I8DotWeight), K a multiple of 32, output channels in panels of 16 (P = ceil(N / 16), the
last panel padded with zero codes and zero scales), per channel n and block b of 32 inputs:
    codes  int8 as uint8 (P, K/32, 8, 16, 4)  int8 weights: [p, b, i, j, e] holds the signed code
                                              c of channel 16 p + j at k = 32 b + 4 i + e
           uint8 (P, K/32, 4, 16, 4)          int4 weights: u = c + 8 in 0..15; [p, b, i, j, e]
                                              holds k = 32 b + 4 i + e (low nibble) and that k + 16
                                              (high nibble) of channel 16 p + j
    d      float16 (P, K/32, 16) block scale, z float16 (P, K/32, 16) block zero (None: symmetric)
    r      float32 (N,)      a power of two per channel, so d and z use float16's precision
    w[n, k] = r[n] (c[n, k] d[n, b] + z[n, b]),  b = k // 32
int4 with zeros, folded (the default where every block allows it, `fold`): the zero becomes part of
the integer code, z/d rounded half to even to a multiple of 1/8, zc = round(8 z / d) + 64 in
0..135, held as int16 in z's place (P, K/32, 16), and r divided by 8:
    w[n, k] = r[n] d[n, b] (8 u[n, k] + zc[n, b] - 128),  u = c + 8 the nibble
so the kernels' sums are exact integers with no float zero term (AVX-512: VPDPBUSD on the byte
8 u + zc, started from -128 S). A block with d = 0 and z != 0, or 8 z / d rounding outside -64 .. 71, keeps
the float zero for its whole layer.
A 64-byte row [p, b, i] is one vector of 16 channels x 4 inputs: the kernel loads a block's
weights once and takes the dot of 4 inputs of a row in every channel with one instruction.

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
FOLD4 = 0x14  # cpu_gemm_i8dot.c: int4 nibbles with the zero folded into the codes


@dataclass
class I8DotWeight:
    codes: torch.Tensor
    d: torch.Tensor
    z: Optional[torch.Tensor]  # float16 zeros, int16 zc when fold, None: symmetric
    r: torch.Tensor
    bits: int  # 8 or 4
    fold: bool = False  # int4 with the zero folded into the codes (z: int16 zc)

    @property
    def kernel_bits(self) -> int:
        """The kernels' `bits` argument: 8, 4, or FOLD4 (int4 nibbles, z the folded zeros zc)."""
        return FOLD4 if self.fold else self.bits

    @property
    def shape(self) -> Tuple[int, int]:
        return self.r.shape[0], self.d.shape[1] * QBLOCK


PANEL = 16  # output channels per panel


def _to_panels(t: torch.Tensor, fill: int = 0) -> torch.Tensor:
    """(N, ...) per channel -> (P, 16, ...), the last panel padded with `fill`."""
    n = t.shape[0]
    p = (n + PANEL - 1) // PANEL
    pad = torch.full((p * PANEL - n,) + tuple(t.shape[1:]), fill, dtype=t.dtype)
    t = torch.cat((t, pad)).view((p, PANEL) + tuple(t.shape[1:]))
    return t


def _params_to_panels(v: torch.Tensor) -> torch.Tensor:
    """float16 (N, K/32) -> (P, K/32, 16)."""
    return _to_panels(v).permute(0, 2, 1).contiguous()


def block_params(v: torch.Tensor, n: int) -> torch.Tensor:
    """A panel layout's d or z (P, K/32, 16) -> (N, K/32)."""
    return v.permute(0, 2, 1).reshape(-1, v.shape[1])[:n]


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


def _fold(d16: torch.Tensor, z16: torch.Tensor) -> Optional[torch.Tensor]:
    """int16 zc = round(8 z / d) + 64 (P, K/32, 16) of float16 panels d, z, or None where a block
    does not allow it (d = 0 with z != 0, or zc outside 0..135); zero-scale blocks take zc = 64."""
    d, z = d16.double(), z16.double()
    zc = torch.round(8 * z / torch.where(d != 0, d, torch.ones_like(d))) + 64
    zc = torch.where(d != 0, zc, torch.full_like(zc, 64.0))
    if bool(((d == 0) & (z != 0)).any()) or bool(((zc < 0) | (zc > 135)).any()):
        return None
    return zc.to(torch.int16)


def repack(codes: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor], group_size: Optional[int],
           bits: int, fold: bool = True) -> I8DotWeight:
    """The one repack: signed codes c (N, K) (int8: -128..127, int4: -8..7), scales / zeros per
    channel (N,) or per group (K // G, N), w = c s + z -> I8DotWeight. fold (int4 with zeros):
    the zeros folded into the codes where every block allows it (the layout above)."""
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
    d16 = _params_to_panels((s / r[:, None]).to(torch.float16))
    z16 = _params_to_panels((z / r[:, None]).to(torch.float16)) if z is not None else None
    kb = k // QBLOCK
    if bits == 8:  # (P, 16, KB, 8, 4) -> (P, KB, 8, 16, 4)
        u = _to_panels(c.to(torch.int8).view(torch.uint8).view(n, kb, 8, 4))
        u = u.permute(0, 2, 3, 1, 4)
    else:  # byte j of a block: k j (low), k j + 16 (high); j = 4 i + e; (P, 16, KB, 4, 4) -> (P, KB, 4, 16, 4)
        u = (c + 8).to(torch.uint8).view(n, kb, 2, QBLOCK // 2)
        u = _to_panels((u[:, :, 0] | (u[:, :, 1] << 4)).view(n, kb, 4, 4), fill=0x88)
        u = u.permute(0, 2, 3, 1, 4)
    if bits == 4 and fold and z16 is not None:
        zc = _fold(d16, z16)
        if zc is not None:
            return I8DotWeight(u.contiguous(), d16, zc.contiguous(), (r / 8).float().contiguous(), bits, True)
    return I8DotWeight(u.contiguous(), d16, z16, r.float().contiguous(), bits)


def signed_codes(p: I8DotWeight) -> torch.Tensor:
    """The signed codes c (N, K) int32 of a repacked weight (the inverse of repack's packing);
    folded int4: the integer codes 8 u + zc - 128 the kernels multiply (w = r d c)."""
    n, k = p.shape
    kb = k // QBLOCK
    b = p.codes.permute(0, 3, 1, 2, 4).reshape(-1, kb, p.codes.shape[2] * 4)[:n]  # (N, KB, bytes)
    if p.bits == 8:
        return b.view(torch.int8).reshape(n, k).to(torch.int32)
    u = torch.stack((b & 0x0F, b >> 4), dim=2).reshape(n, k).to(torch.int32)
    if p.fold:
        zc = block_params(p.z, n).to(torch.int32).repeat_interleave(QBLOCK, dim=1)
        return 8 * u + zc - 128
    return u - 8


def dequantize(p: I8DotWeight, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """w (N, K) = r (c d + z) of a repacked weight, in `dtype` (float64: exact)."""
    n, k = p.shape
    c = signed_codes(p).to(torch.float64).view(n, k // QBLOCK, QBLOCK)
    w = c * block_params(p.d, n).double()[:, :, None]
    if p.z is not None and not p.fold:
        w = w + block_params(p.z, n).double()[:, :, None]
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
    plus each block's zero times its activation sum (folded int4: part of the integer codes);
    float64 (M, N)."""
    m, k = x.shape
    n = p.shape[0]
    q, xd = quantize_q8_ref(x)
    qb = q.to(torch.int64).view(m, k // QBLOCK, QBLOCK)
    c = signed_codes(p).to(torch.int64).view(n, k // QBLOCK, QBLOCK)
    t = torch.einsum("mbi,nbi->mnb", qb, c).double()  # exact integer block dots
    y = (t * xd.double()[:, None, :] * block_params(p.d, n).double()[None, :, :]).sum(dim=2)
    if p.z is not None and not p.fold:
        s = qb.sum(dim=2).double() * xd.double()  # (M, B): each block's activation sum
        y = y + s @ block_params(p.z, n).double().t()
    return y * p.r.double()[None, :]
