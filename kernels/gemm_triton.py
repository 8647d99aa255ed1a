"""Triton GEMMs on quantized weights: W4A16 (int4 groups, GPTQ g_idx), W8A16 (int8 / fp8 weight
only) and FP8 W8A8 with its per-token activation quantizer. Layouts and references: gemm_ref.py.

All compute y (M, N) = x (M, K) @ W^T with fp32 accumulation; weights are dequantized in
registers tile by tile, so only the packed bytes travel from memory (the point of W4A16 for
bandwidth-bound decode).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .kv_write_triton import round_to_e4m3
from .triton_common import (TORCH_FLOATS, check_device, check_dtype, check_last_contiguous, check_shape,
                            dot_upcast, is_interpreter, mm, next_pow2)
from .gemm_ref import FP8_MIN_AMAX
from .gemm_tuning import CACHE, GemmConfig, split_ranges

# Group scales / zeros as engines store them: float16 (format 3), bfloat16, or float32 (imported
# and older engines); every kernel widens them to float32 as it loads them.
_PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _store_out(acc, out_ptr, bias_ptr, part_ptr, rm, rn, M, N, stride_o_m, split,
               HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr):
    """The tile's result: to out (+ bias), or as float32 partial `split` of a split-K GEMM."""
    omask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT:
        # partials: (splits, M, N) float32, row-major
        tl.store(part_ptr + (split * M + rm[:, None]) * N + rn[None, :], acc, mask=omask)
    else:
        if HAS_BIAS:
            acc = acc + tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rm[:, None] * stride_o_m + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _split_k_reduce_kernel(part_ptr, bias_ptr, out_ptr, M, N, stride_o_m, num_splits,
                           HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    # out[m, n] = sum_s part[s, m, n] (+ bias[n]), s in order 0..S-1: the same bits every run
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < M * N
    acc = tl.zeros((BLOCK,), tl.float32)
    for s in range(0, num_splits):
        acc += tl.load(part_ptr + s * M * N + i, mask=mask, other=0.0)
    rm = i // N
    rn = i % N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rm * stride_o_m + rn, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _w4a16_gemm_kernel(x_ptr, qw_ptr, scales_ptr, zeros_ptr, gidx_ptr, bias_ptr, out_ptr, part_ptr,
                       M, N, K, stride_x_m, stride_qw_n, stride_s_g, stride_o_m, group_size, k_per_split,
                       HAS_GIDX: tl.constexpr, GROUP_ALIGNED: tl.constexpr, HAS_BIAS: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       SPLIT: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                       HAS_ZEROS: tl.constexpr = True):
    rm = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2).to(tl.int64)
    mmask = rm < M
    nmask = rn < N
    rb = tl.arange(0, BLOCK_K // 2)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    k_lo = split * k_per_split
    for k0 in range(k_lo, tl.minimum(k_lo + k_per_split, K), BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        kmask = rk < K
        x = tl.load(x_ptr + rm[:, None] * stride_x_m + rk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        cdt = x.dtype
        if UPCAST:
            cdt = tl.float32
        wmask = kmask[:, None] & nmask[None, :]
        # byte j of row n holds k = 2j (low nibble) and k = 2j + 1 (high nibble): each byte is
        # loaded once, (BLOCK_N, BLOCK_K/2) bytes a tile, and both nibbles unpacked in registers
        kb = k0 // 2 + rb
        packed = tl.load(qw_ptr + rn[:, None] * stride_qw_n + kb[None, :],
                         mask=nmask[:, None] & (kb < K // 2)[None, :], other=0).to(tl.int32)
        q = tl.trans(tl.interleave(packed & 0xF, (packed >> 4) & 0xF)).to(tl.float32)  # (BLOCK_K, BLOCK_N)
        # w[k, n] = (q - 8) * scale[g, n] + zero[g, n]   (symmetric, no zeros tensor: zero = 0)
        # (w is a tile in every branch: a scalar placeholder for z would not compile)
        if HAS_GIDX:
            g = tl.load(gidx_ptr + rk, mask=kmask, other=0).to(tl.int64)
            s = tl.load(scales_ptr + g[:, None] * stride_s_g + rn[None, :], mask=wmask, other=0.0).to(tl.float32)
            w = (q - 8.0) * s
            if HAS_ZEROS:
                w += tl.load(zeros_ptr + g[:, None] * stride_s_g + rn[None, :], mask=wmask, other=0.0).to(tl.float32)
        elif GROUP_ALIGNED:
            # the whole K tile lies in one group: one (BLOCK_N,) row of scales / zeros
            g = k0 // group_size
            s = tl.load(scales_ptr + g * stride_s_g + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
            w = (q - 8.0) * s
            if HAS_ZEROS:
                w += tl.load(zeros_ptr + g * stride_s_g + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
        else:
            g = (rk // group_size).to(tl.int64)
            s = tl.load(scales_ptr + g[:, None] * stride_s_g + rn[None, :], mask=wmask, other=0.0).to(tl.float32)
            w = (q - 8.0) * s
            if HAS_ZEROS:
                w += tl.load(zeros_ptr + g[:, None] * stride_s_g + rn[None, :], mask=wmask, other=0.0).to(tl.float32)
        acc += mm(x.to(cdt), w.to(x.dtype).to(cdt), IEEE)
    _store_out(acc, out_ptr, bias_ptr, part_ptr, rm, rn, M, N, stride_o_m, split, HAS_BIAS, SPLIT)


@triton.jit
def _w8a16_gemm_kernel(x_ptr, qw_ptr, scales_ptr, zeros_ptr, bias_ptr, out_ptr, part_ptr,
                       M, N, K, stride_x_m, stride_qw_n, stride_s_g, stride_o_m, group_size, k_per_split,
                       GROUPED: tl.constexpr, HAS_ZEROS: tl.constexpr, GROUP_ALIGNED: tl.constexpr,
                       HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    rm = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2).to(tl.int64)
    mmask = rm < M
    nmask = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    k_lo = split * k_per_split
    for k0 in range(k_lo, tl.minimum(k_lo + k_per_split, K), BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        kmask = rk < K
        x = tl.load(x_ptr + rm[:, None] * stride_x_m + rk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        cdt = x.dtype
        if UPCAST:
            cdt = tl.float32
        wmask = kmask[:, None] & nmask[None, :]
        q = tl.load(qw_ptr + rn[None, :] * stride_qw_n + rk[:, None], mask=wmask, other=0.0)
        if not GROUPED:
            # int8 and e4m3 values are exact in fp16 / bf16, so the cast loses nothing
            acc += mm(x.to(cdt), q.to(tl.float32).to(cdt), IEEE)
        elif GROUP_ALIGNED:
            # the K tile lies in one group g: y += (x @ q^T) * scale[g, n] + (sum_k x) * zero[g, n]
            g = k0 // group_size
            sg = tl.load(scales_ptr + g * stride_s_g + rn, mask=nmask, other=0.0).to(tl.float32)
            acc += mm(x.to(cdt), q.to(tl.float32).to(cdt), IEEE) * sg[None, :]
            if HAS_ZEROS:
                zg = tl.load(zeros_ptr + g * stride_s_g + rn, mask=nmask, other=0.0).to(tl.float32)
                acc += tl.sum(x.to(tl.float32), axis=1)[:, None] * zg[None, :]
        else:
            # groups cut the tile: w[k, n] = q * scale[g, n] + zero[g, n] per element, g = k // G
            g = (rk // group_size).to(tl.int64)
            sg = tl.load(scales_ptr + g[:, None] * stride_s_g + rn[None, :], mask=wmask, other=0.0).to(tl.float32)
            w = q.to(tl.float32) * sg
            if HAS_ZEROS:
                w += tl.load(zeros_ptr + g[:, None] * stride_s_g + rn[None, :], mask=wmask, other=0.0).to(tl.float32)
            acc += mm(x.to(cdt), w.to(x.dtype).to(cdt), IEEE)
    if not GROUPED:
        # per-output-channel scale factors out of the K sum: y = (x @ q^T) * scale[n]
        acc = acc * tl.load(scales_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    _store_out(acc, out_ptr, bias_ptr, part_ptr, rm, rn, M, N, stride_o_m, split, HAS_BIAS, SPLIT)


@triton.jit
def _fp8_quant_per_token_kernel(x_ptr, xq_ptr, scale_ptr, K, stride_x_m, stride_xq_m, min_amax,
                                BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros((BLOCK_K,), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_x_m + rk, mask=rk < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    # scale = max(amax, tiny) / 448, so amax maps to the largest finite E4M3 value
    scale = tl.maximum(tl.max(amax, axis=0), min_amax) / 448.0
    tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_x_m + rk, mask=rk < K, other=0.0).to(tl.float32)
        y = tl.minimum(tl.maximum(x / scale, -448.0), 448.0)
        tl.store(xq_ptr + row * stride_xq_m + rk, round_to_e4m3(y).to(tl.float8e4nv), mask=rk < K)


@triton.jit
def _fp8_gemm_kernel(xq_ptr, x_scale_ptr, qw_ptr, w_scale_ptr, bias_ptr, out_ptr, part_ptr,
                     M, N, K, stride_x_m, stride_qw_n, stride_o_m, k_per_split,
                     HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, OPERANDS: tl.constexpr):
    rm = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2).to(tl.int64)
    mmask = rm < M
    nmask = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    k_lo = split * k_per_split
    for k0 in range(k_lo, tl.minimum(k_lo + k_per_split, K), BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        kmask = rk < K
        a = tl.load(xq_ptr + rm[:, None] * stride_x_m + rk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(qw_ptr + rn[None, :] * stride_qw_n + rk[:, None], mask=kmask[:, None] & nmask[None, :], other=0.0)
        if OPERANDS == 0:  # native FP8 tensor cores (sm89+)
            # Hopper's FP8 wgmma sums in reduced precision; Triton's sm90 default (2^30) lets a
            # whole BLOCK_K tile (BLOCK_K / 32 wgmma steps) pile up there before it reaches fp32.
            # 32 = one wgmma K step: every instruction's sum goes to the fp32 accumulator (the
            # sm90 PTX has one set of fp32 adds per wgmma), so any tile shape rounds alike
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=32)
        else:  # interpreter: E4M3 values are exact in fp32
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    # y = (x_q @ w_q^T) * x_scale[m] * w_scale[n]
    xs = tl.load(x_scale_ptr + rm, mask=mmask, other=0.0)
    ws = tl.load(w_scale_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
    acc = acc * xs[:, None] * ws[None, :]
    _store_out(acc, out_ptr, bias_ptr, part_ptr, rm, rn, M, N, stride_o_m, split, HAS_BIAS, SPLIT)


def _prep_x(x: torch.Tensor, k: int, name: str = "x") -> torch.Tensor:
    check_dtype(name, x, TORCH_FLOATS)
    if x.shape[-1] != k:
        raise ValueError(f"{name}: last dim {x.shape[-1]} does not match the weight's in_features {k}")
    x2 = x.reshape(-1, k)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _check_bias(bias: Optional[torch.Tensor], n: int) -> None:
    if bias is not None:
        check_shape("bias", bias, (n,))
        check_dtype("bias", bias, TORCH_FLOATS)


def _out_2d(out: Optional[torch.Tensor], x: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """The (M, N) output: a new tensor, or a view of the caller's contiguous (..., N) `out`."""
    if out is None:
        return torch.empty((m, n), dtype=x.dtype, device=x.device)
    check_shape("out", out, (*x.shape[:-1], n))
    if out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"out: must be a contiguous {x.dtype} tensor")
    return out.view(m, n)


def _run_tuned(name: str, variant: tuple, kernel, m: int, n: int, k: int, x2: torch.Tensor,
               out: torch.Tensor, bias: Optional[torch.Tensor], ptrs: tuple, ints: tuple, consts,
               block_k_of=lambda bk: bk) -> None:
    """Launch `kernel` with the config of (name, variant, row bucket, N, K) from gemm_tuning.CACHE.

    Kernel arguments: *ptrs, bias, out, part, M, N, K, *ints, k_per_split, constexprs;
    consts(block_k) gives the variant's constexprs for a K tile. split_k > 1: float32 partials
    (splits, M, N), then a fixed-order sum (deterministic, no atomics) adds the bias and casts."""
    def launch(cfg: GemmConfig) -> None:
        block_k = block_k_of(cfg.block_k)
        splits, per_split = split_ranges(k, block_k, cfg.split_k)
        part = torch.empty((splits, m, n), dtype=torch.float32, device=x2.device) if splits > 1 else out
        # Grid: (M tiles, N tiles, K splits)
        kernel[(triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), splits)](
            *ptrs, bias if bias is not None else x2, out, part, m, n, k, *ints, per_split,
            HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k,
            SPLIT=splits > 1, **consts(block_k), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        if splits > 1:
            # partials (S, M, N) -> out (M, N); one program per 1024 outputs
            _split_k_reduce_kernel[(triton.cdiv(m * n, 1024),)](
                part, bias if bias is not None else x2, out, m, n, out.stride(0), splits,
                HAS_BIAS=bias is not None, BLOCK=1024, num_warps=4)
    launch(CACHE.pick(name, variant, m, n, k, x2.device, launch))


def w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
               group_size: int, g_idx: Optional[torch.Tensor] = None,
               bias: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y = x @ dequant_int4(qweight, scales, zeros)^T (+ bias); x (..., K) -> (..., N) in x's dtype.
    zeros None: the symmetric int4 layout (zero 0)."""
    check_dtype("qweight", qweight, (torch.uint8,))
    n, k = qweight.shape[0], qweight.shape[1] * 2
    if group_size <= 0 or k % group_size:
        raise ValueError(f"group_size: must divide in_features {k}, got {group_size}")
    check_last_contiguous("qweight", qweight)
    for name, t in (("scales", scales), ("zeros", zeros)):
        if t is None and name == "zeros":
            continue
        check_shape(name, t, (k // group_size, n))
        check_dtype(name, t, _PARAM_DTYPES)
        check_last_contiguous(name, t)
    if zeros is not None and zeros.stride() != scales.stride():
        raise ValueError("zeros: must have the same strides as scales")
    if g_idx is not None:
        check_shape("g_idx", g_idx, (k,))
        check_dtype("g_idx", g_idx, (torch.int32, torch.int64))
    _check_bias(bias, n)
    x2 = _prep_x(x, k)
    check_device(x2, qweight=qweight, scales=scales, zeros=zeros, g_idx=g_idx, bias=bias)
    m = x2.shape[0]
    out = _out_2d(out, x, m, n)
    if m:
        upcast = dot_upcast(x.dtype)
        pow2 = group_size & (group_size - 1) == 0
        # x: (M, K); qweight: (N, K//2) uint8; scales/zeros: (K//G, N); out: (M, N)
        _run_tuned("w4a16", (g_idx is not None, group_size, x.dtype, zeros is not None), _w4a16_gemm_kernel, m, n, k,
                   x2, out, bias, (x2, qweight, scales, zeros if zeros is not None else scales,
                                   g_idx if g_idx is not None else qweight),
                   (x2.stride(0), qweight.stride(0), scales.stride(0), out.stride(0), group_size),
                   lambda bk: dict(HAS_GIDX=g_idx is not None, GROUP_ALIGNED=group_size % bk == 0,
                                   HAS_ZEROS=zeros is not None,
                                   UPCAST=upcast, IEEE=upcast or x.dtype == torch.float32),
                   # a K tile inside one group when possible
                   block_k_of=lambda bk: max(16, min(bk, group_size)) if pow2 else bk)
    return out.reshape(*x.shape[:-1], n)


def w8a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
               bias: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
               zeros: Optional[torch.Tensor] = None, group_size: Optional[int] = None) -> torch.Tensor:
    """Weight-only GEMM: y = x @ (qweight * scales[:, None])^T (+ bias); qweight int8 or e4m3 (N, K).
    With group_size: scales (and optional zeros) float32 (K // G, N), y = x @ (q * scales[g, n] + zeros[g, n])^T."""
    check_dtype("qweight", qweight, (torch.int8, torch.float8_e4m3fn))
    n, k = qweight.shape
    check_last_contiguous("qweight", qweight)
    if group_size is None:
        if zeros is not None:
            raise ValueError("zeros: only with group_size (the grouped layout)")
        check_shape("scales", scales, (n,))
    else:
        if group_size <= 0 or k % group_size:
            raise ValueError(f"group_size: must divide in_features {k}, got {group_size}")
        check_shape("scales", scales, (k // group_size, n))
        check_last_contiguous("scales", scales)
        if zeros is not None:
            check_shape("zeros", zeros, (k // group_size, n))
            check_dtype("zeros", zeros, _PARAM_DTYPES)
            if zeros.stride() != scales.stride():
                raise ValueError("zeros: must have the same strides as scales")
    check_dtype("scales", scales, _PARAM_DTYPES)
    _check_bias(bias, n)
    x2 = _prep_x(x, k)
    check_device(x2, qweight=qweight, scales=scales, zeros=zeros, bias=bias)
    m = x2.shape[0]
    out = _out_2d(out, x, m, n)
    if m:
        grouped = group_size is not None
        pow2 = grouped and group_size & (group_size - 1) == 0
        upcast = dot_upcast(x.dtype)
        # x: (M, K); qweight: (N, K); scales: (N,) or (K//G, N); zeros: (K//G, N); out: (M, N)
        _run_tuned("w8a16", (str(qweight.dtype), group_size, zeros is not None, x.dtype), _w8a16_gemm_kernel,
                   m, n, k, x2, out, bias, (x2, qweight, scales, zeros if zeros is not None else scales),
                   (x2.stride(0), qweight.stride(0), scales.stride(0) if grouped else 0, out.stride(0),
                    group_size or 1),
                   lambda bk: dict(GROUPED=grouped, HAS_ZEROS=zeros is not None,
                                   GROUP_ALIGNED=grouped and group_size % bk == 0,
                                   UPCAST=upcast, IEEE=upcast or x.dtype == torch.float32),
                   block_k_of=lambda bk: max(16, min(bk, group_size)) if pow2 else bk)
    return out.reshape(*x.shape[:-1], n)


def quantize_fp8_per_token(x: torch.Tensor):
    """x (M, K) float -> (x_q float8_e4m3fn (M, K), scale float32 (M,)), scale = amax / 448."""
    check_dtype("x", x, TORCH_FLOATS)
    if x.dim() != 2:
        raise ValueError(f"x: expected (tokens, features), got {tuple(x.shape)}")
    check_last_contiguous("x", x)
    m, k = x.shape
    xq = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((m,), dtype=torch.float32, device=x.device)
    if m:
        # x, x_q: (M, K) row-major; scale: (M,). One program per token row, two passes over K.
        _fp8_quant_per_token_kernel[(m,)](x, xq, scale, k, x.stride(0), xq.stride(0), FP8_MIN_AMAX,
                                          BLOCK_K=min(next_pow2(k), 1024), num_warps=4)
    return xq, scale


def _fp8_operands(device: torch.device) -> int:
    """2: interpreter (fp32 dot); 0: native FP8 tensor cores. Triton has no E4M3 below sm89."""
    if is_interpreter():
        return 2
    if torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError("fp8 GEMM: needs a GPU of compute capability >= 8.9 (Ada, Hopper); "
                         "use the reference path (TRITIUM_KERNELS=reference) on older GPUs")
    return 0


def fp8_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
             bias: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """FP8 W8A8: per-token E4M3 activations times per-channel E4M3 weights (N, K); (..., K) -> (..., N)."""
    check_dtype("qweight", qweight, (torch.float8_e4m3fn,))
    n, k = qweight.shape
    check_last_contiguous("qweight", qweight)
    check_shape("scales", scales, (n,))
    check_dtype("scales", scales, _PARAM_DTYPES)
    _check_bias(bias, n)
    x2 = _prep_x(x, k)
    check_device(x2, qweight=qweight, scales=scales, bias=bias)
    m = x2.shape[0]
    out = _out_2d(out, x, m, n)
    if m:
        xq, xs = quantize_fp8_per_token(x2)
        operands = _fp8_operands(x.device)
        # x_q: (M, K) e4m3; x_scale: (M,); qweight: (N, K) e4m3; scales: (N,); out: (M, N)
        _run_tuned("fp8", (x.dtype,), _fp8_gemm_kernel, m, n, k, x2, out, bias, (xq, xs, qweight, scales),
                   (xq.stride(0), qweight.stride(0), out.stride(0)), lambda bk: dict(OPERANDS=operands))
    return out.reshape(*x.shape[:-1], n)
