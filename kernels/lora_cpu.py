"""The CPU multi-LoRA delta: the native kernel (cpu_lora.c) where it runs, else the grouped GEMMs.

`lora_add_cpu(y, x, a_stack, bt_stack, seg, row_slots, ranks)` adds every row's delta to y in
place (layouts in lora_ref.py; ranks (S,) int64: the rank each slot uses on this linear). The
native kernel takes all rows of the step in one call (shrink, expand and the add to y in one
pass, no gather, scatter or padding), rows grouped by slot so a weight load serves several rows,
each row computed alone, so a row's result never depends on the others (docs/determinism.md).
It takes bfloat16 or float32 tensors of one dtype; anything else (float16, non-contiguous rows,
native kernels off) goes through lora_ref.lora_add_grouped.
"""
from __future__ import annotations

import torch

from . import cpu_native
from .lora_ref import LoRASegments, lora_add_grouped

NATIVE_DTYPES = (torch.bfloat16, torch.float32)


def native_ok(y: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor, bt_stack: torch.Tensor) -> bool:
    return (x.dtype == y.dtype == a_stack.dtype == bt_stack.dtype and x.dtype in NATIVE_DTYPES
            and x.dim() == 2 and y.dim() == 2 and x.is_contiguous() and y.is_contiguous()
            and a_stack.is_contiguous() and bt_stack.is_contiguous() and not x.is_cuda
            and cpu_native.available())


def lora_add_native(y: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor, bt_stack: torch.Tensor,
                    row_slots: torch.Tensor, ranks: torch.Tensor = None) -> torch.Tensor:
    """y (T, N) += B[s_i] A[s_i] x[i] for rows with row_slots[i] >= 0 (int64 (T,)), slot s using
    its first ranks[s] ranks (default: all R); the native kernel."""
    t, k = x.shape
    s, r, n = bt_stack.shape
    if ranks is None:
        ranks = torch.full((s,), r, dtype=torch.int64)
    assert y.shape == (t, n) and a_stack.shape == (s, r, k) and row_slots.shape == (t,) and ranks.shape == (s,)
    assert row_slots.dtype == ranks.dtype == torch.int64 and row_slots.is_contiguous() and ranks.is_contiguous()
    rc = cpu_native._lib().tritium_lora_add(x.data_ptr(), y.data_ptr(), a_stack.data_ptr(), bt_stack.data_ptr(),
                                            ranks.data_ptr(), row_slots.data_ptr(), t, k, n, s, r,
                                            int(x.dtype == torch.bfloat16))
    if rc != 0:
        raise ValueError(f"native LoRA kernel: bad arguments (rank {r}, ranks {ranks.tolist()}, "
                         f"{s} slots) or out of memory (code {rc})")
    return y


def lora_add_cpu(y: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor, bt_stack: torch.Tensor,
                 seg: LoRASegments, row_slots: torch.Tensor, ranks: torch.Tensor) -> torch.Tensor:
    """y += the step's delta in place (returns y): the native kernel, else the grouped GEMMs."""
    if native_ok(y, x, a_stack, bt_stack) and a_stack.shape[1] <= 1024:
        return lora_add_native(y, x, a_stack, bt_stack, row_slots, ranks)
    return lora_add_grouped(y, x.to(a_stack.dtype), a_stack, bt_stack, seg)
