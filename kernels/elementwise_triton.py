"""Triton kernels for the fused element-wise ops: RMSNorm(+residual), neox RoPE, SiLU-and-mul.

Each launcher checks its inputs and returns what the torch reference beside it returns
(rms_norm_ref, rotary_ref, silu_mul_ref). Maths run in float32 and round once to the I/O dtype.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .triton_common import TORCH_FLOATS, check_device, check_dtype, check_last_contiguous, check_shape, next_pow2


def _out_or_new(out: Optional[torch.Tensor], name: str, like: torch.Tensor, shape=None) -> torch.Tensor:
    shape = tuple(like.shape) if shape is None else tuple(shape)
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    check_shape(name, out, shape)
    if out.dtype != like.dtype or not out.is_contiguous() or out.device != like.device:
        raise ValueError(f"{name}: must be a contiguous {like.dtype} tensor on {like.device}")
    return out


# ---------------------------------------------------------------- RMSNorm (+ residual)
@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
                     stride_x_row, stride_res_row, stride_out_row, stride_res_out_row,
                     n_cols, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x_row + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res_row + cols, mask=mask, other=0.0)
        # x = x + residual, rounded to the I/O dtype like the torch add, is the new residual.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * stride_res_out_row + cols, x, mask=mask)
    xf = x.to(tl.float32)
    # out = weight * (x / sqrt(mean(x^2) + eps))
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    y = (xf * rstd).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_out_row + cols, (w.to(tl.float32) * y.to(tl.float32)).to(x.dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
             residual_out: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim of x (T, H); with residual, normalises x + residual.

    Returns (normed, residual_out) like rms_norm_ref; residual_out is x itself without residual.
    out / residual_out: optional preallocated (T, H) outputs.
    """
    check_dtype("x", x, TORCH_FLOATS)
    if x.dim() != 2:
        raise ValueError(f"x: expected (tokens, hidden), got shape {tuple(x.shape)}")
    t, h = x.shape
    check_shape("weight", weight, (h,))
    check_last_contiguous("x", x)
    check_device(x, weight=weight, residual=residual)
    if weight.dtype != x.dtype:
        raise ValueError(f"weight: dtype {weight.dtype} must match x dtype {x.dtype}")
    out = _out_or_new(out, "out", x)
    if residual is not None:
        check_shape("residual", residual, (t, h))
        check_last_contiguous("residual", residual)
        if residual.dtype != x.dtype:
            raise ValueError(f"residual: dtype {residual.dtype} must match x dtype {x.dtype}")
        res_out = _out_or_new(residual_out, "residual_out", x)
    else:
        res_out = x
    if t == 0:
        return out, res_out
    block_n = next_pow2(h)
    # x, residual, out, res_out: (T, H) row-major; weight: (H,). One program per token row.
    _rms_norm_kernel[(t,)](
        x, residual if residual is not None else x, weight.contiguous(), out, res_out,
        x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0), res_out.stride(0),
        h, float(eps), HAS_RESIDUAL=residual is not None, BLOCK_N=block_n,
        num_warps=min(max(block_n // 256, 1), 16))
    return out, res_out


# ---------------------------------------------------------------- rotary (neox)
@triton.jit
def _rotary_kernel(x_ptr, out_ptr, pos_ptr, cs_ptr,
                   stride_x_tok, stride_x_head, stride_out_tok, stride_out_head, stride_cs_pos,
                   num_heads, half,
                   BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    heads = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_HALF)
    mask = (heads[:, None] < num_heads) & (i[None, :] < half)
    cos = tl.load(cs_ptr + pos * stride_cs_pos + i, mask=i < half, other=0.0)[None, :]
    sin = tl.load(cs_ptr + pos * stride_cs_pos + half + i, mask=i < half, other=0.0)[None, :]
    base = x_ptr + tok * stride_x_tok + heads[:, None] * stride_x_head + i[None, :]
    x1 = tl.load(base, mask=mask, other=0.0)
    x2 = tl.load(base + half, mask=mask, other=0.0)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    # RoFormer, rotate-half layout: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)
    o1 = x1f * cos - x2f * sin
    o2 = x2f * cos + x1f * sin
    obase = out_ptr + tok * stride_out_tok + heads[:, None] * stride_out_head + i[None, :]
    tl.store(obase, o1.to(x1.dtype), mask=mask)
    tl.store(obase + half, o2.to(x1.dtype), mask=mask)


def _rotary_one(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                out: Optional[torch.Tensor], name: str) -> torch.Tensor:
    t, h, d = x.shape
    out = _out_or_new(out, name, x)
    if t == 0:
        return out
    half = d // 2
    block_h = min(next_pow2(h), 16)
    # x: (T, H, D) with any token/head strides, last dim contiguous; out: (T, H, D) contiguous;
    # cos_sin_cache: (max_pos, D) float32 = [cos | sin]. Grid: (token, head block).
    _rotary_kernel[(t, triton.cdiv(h, block_h))](
        x, out, positions, cos_sin_cache,
        x.stride(0), x.stride(1), out.stride(0), out.stride(1), cos_sin_cache.stride(0),
        h, half, BLOCK_H=block_h, BLOCK_HALF=next_pow2(half), num_warps=4)
    return out


def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
           cos_sin_cache: torch.Tensor, q_out: Optional[torch.Tensor] = None,
           k_out: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Neox RoPE on q (T, Hq, D) and k (T, Hkv, D) at positions (T,); returns new (q, k).

    cos_sin_cache is (max_pos, D) float32 [cos | sin] (rope_cos_sin_cache, any scaling);
    q_out / k_out: optional preallocated contiguous outputs.
    """
    for name, x in (("q", q), ("k", k)):
        check_dtype(name, x, TORCH_FLOATS)
        if x.dim() != 3:
            raise ValueError(f"{name}: expected (tokens, heads, head_dim), got {tuple(x.shape)}")
        check_last_contiguous(name, x)
    t, _, d = q.shape
    if d % 2:
        raise ValueError(f"q: head_dim must be even for rotary, got {d}")
    check_shape("k", k, (t, None, d))
    check_shape("positions", positions, (t,))
    check_dtype("positions", positions, (torch.int32, torch.int64))
    check_shape("cos_sin_cache", cos_sin_cache, (None, d))
    check_dtype("cos_sin_cache", cos_sin_cache, (torch.float32,))
    check_last_contiguous("cos_sin_cache", cos_sin_cache)
    check_device(q, k=k, positions=positions, cos_sin_cache=cos_sin_cache)
    return (_rotary_one(q, positions, cos_sin_cache, q_out, "q_out"),
            _rotary_one(k, positions, cos_sin_cache, k_out, "k_out"))


# ---------------------------------------------------------------- SiLU-and-mul
@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x_row, stride_out_row, n,
                     BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < n
    gate = tl.load(x_ptr + row * stride_x_row + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x_row + n + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    # silu(g) * up = g / (1 + exp(-g)) * up
    y = g / (1.0 + tl.exp(-g)) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_out_row + cols, y.to(gate.dtype), mask=mask)


def silu_mul(x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x (..., 2n) = [gate | up] -> silu(gate) * up, shape (..., n); out: optional (..., n)."""
    check_dtype("x", x, TORCH_FLOATS)
    if x.shape[-1] % 2:
        raise ValueError(f"x: last dim must be even ([gate | up]), got {x.shape[-1]}")
    check_last_contiguous("x", x)
    n = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * n)
    rows = x2.shape[0]
    out = _out_or_new(out, "out", x, (*x.shape[:-1], n)).view(rows, n)
    if rows and n:
        block_n = min(next_pow2(n), 1024)
        # x: (rows, 2n) = [gate | up]; out: (rows, n). Grid: (row, column block).
        _silu_mul_kernel[(rows, triton.cdiv(n, block_n))](
            x2, out, x2.stride(0), out.stride(0), n, BLOCK_N=block_n, num_warps=4)
    return out.reshape(*x.shape[:-1], n)
