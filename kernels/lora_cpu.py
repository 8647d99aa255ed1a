"""The CPU multi-LoRA delta: the native kernel (cpu_lora.c) where it runs, else the grouped GEMMs.

`BoundLoRA(a_stack, bt_stack, ranks).add(y, x, seg, row_slots)` (or `lora_add_cpu`) adds every row's delta to y in
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


class BoundLoRA:
    """One linear's stacks (cut to the largest rank in use) bound to the native kernel, so a
    step's call passes only x, y and the rows' slots (the engine calls it for every adapted
    linear of every step). None of it applies where the native kernel does not: see `usable`."""

    def __init__(self, a_stack: torch.Tensor, bt_stack: torch.Tensor, ranks: torch.Tensor):
        self.a, self.bt, self.ranks = a_stack.contiguous(), bt_stack.contiguous(), ranks.to(torch.int64).contiguous()
        s, r, self.k = self.a.shape
        self.n = self.bt.shape[2]
        self.dtype = self.a.dtype
        self.lib = cpu_native._lib() if (self.dtype in NATIVE_DTYPES and self.bt.dtype == self.dtype
                                         and not self.a.is_cuda and r <= 1024) else None
        self._args = (self.a.data_ptr(), self.bt.data_ptr(), self.ranks.data_ptr())
        self._shape = (self.k, self.n, s, r, int(self.dtype == torch.bfloat16))

    def add(self, y: torch.Tensor, x: torch.Tensor, seg: LoRASegments, row_slots: torch.Tensor) -> torch.Tensor:
        """y += the step's delta in place (returns y): the native kernel, else the grouped GEMMs."""
        if (self.lib is not None and x.dtype == self.dtype and y.dtype == self.dtype and x.dim() == 2
                and x.is_contiguous() and y.is_contiguous() and x.shape[1] == self.k and y.shape[1] == self.n):
            rc = self.lib.tritium_lora_add(x.data_ptr(), y.data_ptr(), *self._args, row_slots.data_ptr(),
                                           x.shape[0], *self._shape)
            if rc != 0:
                raise ValueError(f"native LoRA kernel failed (code {rc})")
            return y
        return lora_add_grouped(y, x.to(self.dtype), self.a, self.bt, seg)


def lora_add_cpu(y: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor, bt_stack: torch.Tensor,
                 seg: LoRASegments, row_slots: torch.Tensor, ranks: torch.Tensor) -> torch.Tensor:
    """y += the step's delta in place (returns y): the native kernel, else the grouped GEMMs."""
    return BoundLoRA(a_stack, bt_stack, ranks).add(y, x, seg, row_slots)
