"""Multi-LoRA delta over a batch whose rows use different adapters: the torch reference and the
grouped CPU path (the Triton kernel is lora_triton.py).

For row i with adapter slot s_i (or none):   y[i] += B[s_i] @ (A[s_i] @ x[i])
The rows of one step are grouped by adapter into segments, as in Punica's SGMV ("Punica:
Multi-Tenant LoRA Serving", Chen et al., MLSys 2024) and S-LoRA (Sheng et al., MLSys 2024), so
each adapter present in the step costs one shrink GEMM (x -> rank) and one expand GEMM
(rank -> out) over its rows, whatever the batch mixes.

Layouts (shared with lora_triton.py):
    x: (T, K) the linear's input rows;  y: (T, N) the base linear's output, updated in place
    a_stack: (S, R, K) per device slot the adapter's A (rank rows; zero rows past its rank)
    bt_stack: (S, R, N) per device slot the adapter's B transposed, LoRA scaling folded in
        (zero rows past its rank), so a rank slice is contiguous
    LoRASegments: rows with an adapter, grouped by slot (below)
"""
from __future__ import annotations

from typing import List, NamedTuple, Optional

import torch


class LoRASegments(NamedTuple):
    """A step's rows grouped by adapter slot (rows without an adapter appear in no segment)."""
    row_ids: torch.Tensor        # (M,) int64: rows of x, segment by segment (device tensor)
    seg_starts: List[int]        # (G + 1) offsets into row_ids
    seg_slots: List[int]         # (G) the device slot of each segment's adapter, ascending
    num_rows: int                # T, the step's rows (checked against x)
    all_rows: Optional[int]      # the slot when one adapter covers every row in order (no gather needed)
    pad_rows: torch.Tensor       # (G * L,) int64: segment g's rows at [g * L, g * L + len_g), row 0 after
    pad_mask: Optional[torch.Tensor]  # (G * L, 1) bool: True at the padding; None when no segment is padded
    max_len: int                 # L, the longest segment

    @classmethod
    def from_row_slots(cls, row_slots: List[Optional[int]], device) -> "LoRASegments":
        """row_slots[i]: slot of row i, None for the base model."""
        by_slot = {}
        for i, s in enumerate(row_slots):
            if s is not None:
                by_slot.setdefault(s, []).append(i)
        ids, starts, slots = [], [0], []
        for s, rows in sorted(by_slot.items()):
            ids.extend(rows)
            starts.append(len(ids))
            slots.append(s)
        only = slots[0] if len(slots) == 1 and len(ids) == len(row_slots) else None
        length = max((len(r) for r in by_slot.values()), default=0)
        pad, mask = [], []
        for s in slots:
            rows = by_slot[s]
            pad.extend(rows + [0] * (length - len(rows)))
            mask.extend([False] * len(rows) + [True] * (length - len(rows)))
        as_ids = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
        pad_mask = torch.tensor(mask, device=device).unsqueeze(1) if any(mask) else None
        return cls(as_ids(ids), starts, slots, len(row_slots), only, as_ids(pad), pad_mask, length)


def lora_delta_ref(x: torch.Tensor, a_stack: torch.Tensor, bt_stack: torch.Tensor,
                   row_slots: torch.Tensor) -> torch.Tensor:
    """Reference: the delta (T, N) in float32, row by row through gathered weights.
    row_slots: (T,) int64, -1 for a row without an adapter."""
    has = row_slots >= 0
    idx = row_slots.clamp(min=0)
    a = a_stack.float()[idx]                   # (T, R, K)
    bt = bt_stack.float()[idx]                 # (T, R, N)
    t = torch.bmm(a, x.float().unsqueeze(2))   # (T, R, 1): A x
    d = torch.bmm(t.transpose(1, 2), bt).squeeze(1)  # (T, N): (A x)^T B^T
    return d * has.unsqueeze(1).to(d.dtype)


def lora_add_grouped(y: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor, bt_stack: torch.Tensor,
                     seg: LoRASegments) -> torch.Tensor:
    """The CPU path: y += delta in place, returns y. One GEMM pair for the whole step: the
    segments, padded to the longest, go through one batched shrink and one batched expand
    (a loop of a GEMM pair per adapter costs several times more in per-call overhead at decode
    sizes). Pass stacks sliced to the largest rank in use (zero padding multiplies to zero)."""
    assert x.shape[0] == seg.num_rows == y.shape[0], (x.shape, y.shape, seg.num_rows)
    g = len(seg.seg_slots)
    if g == 0:
        return y
    if seg.all_rows is not None:  # one adapter on every row: no gather, no scatter
        return y.addmm_(x @ a_stack[seg.all_rows].t(), bt_stack[seg.all_rows])
    if g != a_stack.shape[0]:
        slots = torch.tensor(seg.seg_slots, device=x.device)
        a_stack, bt_stack = a_stack.index_select(0, slots), bt_stack.index_select(0, slots)
    xp = x.index_select(0, seg.pad_rows)
    if seg.pad_mask is not None:
        xp.masked_fill_(seg.pad_mask, 0)  # padding rows add zero to row 0
    t = torch.bmm(xp.view(g, seg.max_len, -1), a_stack.transpose(1, 2))  # (G, L, R)
    d = torch.bmm(t, bt_stack)                                           # (G, L, N)
    return y.index_add_(0, seg.pad_rows, d.view(g * seg.max_len, -1))
