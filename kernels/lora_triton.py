"""Segmented multi-LoRA kernels (the GPU path of lora_ref.py): shrink then expand, as in Punica's
SGMV ("Punica: Multi-Tenant LoRA Serving", Chen et al., MLSys 2024) and S-LoRA (Sheng et al., 2024).

The step's rows with an adapter are grouped by device slot (LoRASegments); each segment is cut
into tiles of BLOCK_M rows that share one adapter, so a tile is a small dense GEMM against that
adapter's A (shrink: x -> t, rank wide) and then its B (expand: t -> y, added to the base output).
Rows are gathered through row_ids, so the batch needs no reordering.
"""
from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl

from .lora_ref import LoRASegments
from .triton_common import (TORCH_FLOATS, check_device, check_dtype, check_last_contiguous, check_shape,
                            dot_upcast, mm, next_pow2)

BLOCK_M = 16


@triton.jit
def _lora_shrink_kernel(x_ptr, a_ptr, t_ptr, row_ids_ptr, tile_start_ptr, tile_len_ptr, tile_slot_ptr,
                        K, R, stride_x_row, stride_a_slot, stride_a_row, stride_t_row,
                        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                        UPCAST: tl.constexpr, IEEE: tl.constexpr):
    # t[j, :] = A[slot] @ x[row_ids[j], :] for the tile's rows j (t in segment order, float32)
    pid = tl.program_id(0).to(tl.int64)
    start = tl.load(tile_start_ptr + pid).to(tl.int64)
    n = tl.load(tile_len_ptr + pid)
    slot = tl.load(tile_slot_ptr + pid).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < n
    rows = tl.load(row_ids_ptr + start + offs_m, mask=mask_m, other=0)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        xt = tl.load(x_ptr + rows[:, None] * stride_x_row + offs_k[None, :],
                     mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        # a: (BLOCK_K, BLOCK_R) view of A[slot]^T
        at = tl.load(a_ptr + slot * stride_a_slot + offs_r[None, :] * stride_a_row + offs_k[:, None],
                     mask=mask_k[:, None] & mask_r[None, :], other=0.0)
        if UPCAST:
            xt, at = xt.to(tl.float32), at.to(tl.float32)
        else:
            xt = xt.to(at.dtype)
        acc += mm(xt, at, IEEE)
    tl.store(t_ptr + (start + offs_m)[:, None] * stride_t_row + offs_r[None, :], acc,
             mask=mask_m[:, None] & mask_r[None, :])


@triton.jit
def _lora_expand_kernel(t_ptr, bt_ptr, y_ptr, row_ids_ptr, tile_start_ptr, tile_len_ptr, tile_slot_ptr,
                        N, R, stride_t_row, stride_bt_slot, stride_bt_rank, stride_y_row,
                        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                        UPCAST: tl.constexpr, IEEE: tl.constexpr):
    # y[row_ids[j], n] += sum_r t[j, r] * Bt[slot][r, n]
    pid = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    start = tl.load(tile_start_ptr + pid).to(tl.int64)
    n_rows = tl.load(tile_len_ptr + pid)
    slot = tl.load(tile_slot_ptr + pid).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < n_rows
    rows = tl.load(row_ids_ptr + start + offs_m, mask=mask_m, other=0)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    t = tl.load(t_ptr + (start + offs_m)[:, None] * stride_t_row + offs_r[None, :],
                mask=mask_m[:, None] & mask_r[None, :], other=0.0)
    # b: (BLOCK_R, BLOCK_N) tile of Bt[slot] (rank rows, output columns contiguous)
    b = tl.load(bt_ptr + slot * stride_bt_slot + offs_r[:, None] * stride_bt_rank + offs_n[None, :],
                mask=mask_r[:, None] & mask_n[None, :], other=0.0)
    if UPCAST:
        b = b.to(tl.float32)
    else:
        t = t.to(b.dtype)
    d = mm(t, b, IEEE)
    y_ptrs = y_ptr + rows[:, None] * stride_y_row + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + d).to(y_ptr.dtype.element_ty), mask=mask)


def _tiles(seg: LoRASegments, device) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(start, length, slot) of every BLOCK_M-row tile of every segment."""
    starts, lens, slots = [], [], []
    for g, slot in enumerate(seg.seg_slots):
        for s in range(seg.seg_starts[g], seg.seg_starts[g + 1], BLOCK_M):
            starts.append(s)
            lens.append(min(BLOCK_M, seg.seg_starts[g + 1] - s))
            slots.append(slot)
    as_t = lambda v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
    return as_t(starts), as_t(lens), as_t(slots)


def lora_add_sgmv(y: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor, bt_stack: torch.Tensor,
                  seg: LoRASegments) -> torch.Tensor:
    """y += the segmented LoRA delta, in place (see lora_ref.lora_add_grouped). Returns y."""
    # x: (T, K); y: (T, N); a_stack: (S, R, K); bt_stack: (S, R, N); row_ids: (M,)
    check_dtype("x", x, TORCH_FLOATS)
    check_dtype("y", y, TORCH_FLOATS)
    check_dtype("a_stack", a_stack, TORCH_FLOATS)
    check_dtype("bt_stack", bt_stack, (a_stack.dtype,))
    t_rows, k = x.shape
    s, r, _ = a_stack.shape
    n = y.shape[1]
    check_shape("y", y, (t_rows, None))
    check_shape("a_stack", a_stack, (None, None, k))
    check_shape("bt_stack", bt_stack, (s, r, n))
    if seg.num_rows != t_rows:
        raise ValueError(f"segments cover {seg.num_rows} rows, x has {t_rows}")
    for name, v in (("x", x), ("y", y), ("a_stack", a_stack), ("bt_stack", bt_stack)):
        check_last_contiguous(name, v)
    check_device(x, y=y, a_stack=a_stack, bt_stack=bt_stack, row_ids=seg.row_ids)
    m = int(seg.row_ids.numel())
    if m == 0:
        return y
    tile_start, tile_len, tile_slot = _tiles(seg, x.device)
    block_r = max(16, next_pow2(r))
    t = torch.empty(m, block_r, dtype=torch.float32, device=x.device)
    upcast = dot_upcast(a_stack.dtype) or a_stack.dtype == torch.float32 or x.dtype != a_stack.dtype
    ieee = a_stack.dtype == torch.float32
    num_tiles = tile_start.numel()
    _lora_shrink_kernel[(num_tiles,)](
        x, a_stack, t, seg.row_ids, tile_start, tile_len, tile_slot, k, r,
        x.stride(0), a_stack.stride(0), a_stack.stride(1), t.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_K=min(64, max(16, next_pow2(k))), UPCAST=upcast, IEEE=ieee)
    block_n = min(64, max(16, next_pow2(n)))
    _lora_expand_kernel[(num_tiles, triton.cdiv(n, block_n))](
        t, bt_stack, y, seg.row_ids, tile_start, tile_len, tile_slot, n, r,
        t.stride(0), bt_stack.stride(0), bt_stack.stride(1), y.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_N=block_n, UPCAST=True, IEEE=ieee)
    return y
