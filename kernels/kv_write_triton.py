"""Triton KV-cache write: scatter new K/V rows into their paged slots, quantizing on the way.

Matches kv_write_ref: INT8 stores round-half-even(x / scale) saturated to [-127, 127]; FP8 E4M3
stores x / scale saturated to +-448 and rounded to the nearest even E4M3 value. A slot < 0 marks a
padding token and is skipped (CUDA-graph padding convention of vLLM).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .triton_common import TORCH_FLOATS, check_device, check_dtype, check_last_contiguous, check_shape, next_pow2


@triton.jit
def round_to_e4m3(y):
    """Round float32 y (|y| <= 448) to the nearest-even E4M3 value, still as float32.

    The cast that follows is then exact. Doing the rounding here keeps GPU and interpreter in
    agreement with torch: Triton 3.9's interpreter rounds fp32->fp8 half-up and drops the carry.
    """
    bits = y.to(tl.int32, bitcast=True)
    # normal range: keep 3 mantissa bits, round to nearest even (carry may bump the exponent)
    lsb = (bits >> 20) & 1
    normal = ((bits + 0x7FFFF + lsb) & -1048576).to(tl.float32, bitcast=True)
    # subnormal range |y| < 2^-6: step 2^-9; adding 1.5 * 2^14 makes fp32 round at that step
    sub = (y + 24576.0) - 24576.0
    return tl.where(tl.abs(y) < 0.015625, sub, normal)


# cache storage kinds (constexpr)
_FLOAT, _INT8, _FP8 = 0, 1, 2


@triton.jit
def _quantize(x, scale, KIND: tl.constexpr):
    """x float32 (H, D), scale float32 (H, 1) -> the cache element dtype."""
    y = x / scale
    if KIND == 1:
        y = tl.minimum(tl.maximum(y, -127.0), 127.0)
        # round half to even, exactly: floor, then look at the fractional part
        r = tl.floor(y)
        frac = y - r
        is_odd = (r - 2.0 * tl.floor(r * 0.5)) == 1.0
        r = tl.where((frac > 0.5) | ((frac == 0.5) & is_odd), r + 1.0, r)
        return r.to(tl.int8)
    else:
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        return round_to_e4m3(y).to(tl.float8e4nv)


@triton.jit
def _kv_write_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
                     stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
                     stride_c_block, stride_c_slot, stride_c_head,
                     block_size, num_heads, head_dim,
                     KIND: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:
        heads = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        mask = (heads[:, None] < num_heads) & (d[None, :] < head_dim)
        blk = slot // block_size
        off = slot % block_size
        c_offs = blk * stride_c_block + off * stride_c_slot + heads[:, None] * stride_c_head + d[None, :]
        k = tl.load(k_ptr + tok * stride_k_tok + heads[:, None] * stride_k_head + d[None, :], mask=mask, other=0.0)
        v = tl.load(v_ptr + tok * stride_v_tok + heads[:, None] * stride_v_head + d[None, :], mask=mask, other=0.0)
        if KIND == 0:
            tl.store(k_cache_ptr + c_offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(v_cache_ptr + c_offs, v.to(v_cache_ptr.dtype.element_ty), mask=mask)
        else:
            ks = tl.load(k_scale_ptr + heads, mask=heads < num_heads, other=1.0)[:, None]
            vs = tl.load(v_scale_ptr + heads, mask=heads < num_heads, other=1.0)[:, None]
            tl.store(k_cache_ptr + c_offs, _quantize(k.to(tl.float32), ks, KIND), mask=mask)
            tl.store(v_cache_ptr + c_offs, _quantize(v.to(tl.float32), vs, KIND), mask=mask)


def kv_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: Optional[torch.Tensor] = None,
             v_scale: Optional[torch.Tensor] = None) -> None:
    """Write k, v (T, Hkv, D) into k_cache/v_cache (num_blocks, block_size, Hkv, D) at slots (T,).

    Float caches take the values cast to their dtype; int8 / float8_e4m3fn caches need k_scale and
    v_scale (Hkv,) float32 and store x / scale quantized.
    """
    for name, x in (("k", k), ("v", v)):
        check_dtype(name, x, TORCH_FLOATS)
        check_last_contiguous(name, x)
    if k.dim() != 3:
        raise ValueError(f"k: expected (tokens, kv_heads, head_dim), got {tuple(k.shape)}")
    t, h, d = k.shape
    check_shape("v", v, (t, h, d))
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache: expected (num_blocks, block_size, kv_heads, head_dim), got {tuple(k_cache.shape)}")
    num_blocks, block_size = k_cache.shape[:2]
    check_shape("k_cache", k_cache, (num_blocks, block_size, h, d))
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    if k_cache.stride() != v_cache.stride() or k_cache.dtype != v_cache.dtype:
        raise ValueError("v_cache: must have the same dtype and strides as k_cache")
    check_last_contiguous("k_cache", k_cache)
    check_shape("slot_mapping", slot_mapping, (t,))
    check_dtype("slot_mapping", slot_mapping, (torch.int32, torch.int64))
    check_device(k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping,
                 k_scale=k_scale, v_scale=v_scale)
    if k_cache.dtype in TORCH_FLOATS:
        kind = _FLOAT
    elif k_cache.dtype in (torch.int8, torch.float8_e4m3fn):
        kind = _INT8 if k_cache.dtype == torch.int8 else _FP8
        if k_scale is None or v_scale is None:
            raise ValueError(f"k_scale/v_scale: required for a {k_cache.dtype} KV cache")
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            check_shape(name, s, (h,))
            check_dtype(name, s, (torch.float32,))
    else:
        raise ValueError(f"k_cache: dtype {k_cache.dtype} not supported; allowed: float32, float16, "
                         f"bfloat16, int8, float8_e4m3fn")
    if t == 0:
        return
    # k, v: (T, Hkv, D) any token/head strides; caches: (num_blocks, block_size, Hkv, D);
    # slot = block_id * block_size + offset. One program per token writes all its heads.
    _kv_write_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping,
        k_scale if k_scale is not None else k, v_scale if v_scale is not None else v,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_size, h, d, KIND=kind, BLOCK_H=next_pow2(h), BLOCK_D=next_pow2(d), num_warps=4)
