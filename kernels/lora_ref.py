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
    b_stack: (S, N, R) per device slot the adapter's B, LoRA scaling folded in (zero columns past its rank)
    LoRASegments: rows with an adapter, grouped by slot (below)
"""
from __future__ import annotations

from typing import List, NamedTuple, Optional

import torch


class LoRASegments(NamedTuple):
    """A step's rows grouped by adapter slot (rows without an adapter appear in no segment)."""
    row_ids: torch.Tensor        # (M,) int64: rows of x, segment by segment (device tensor)
    seg_starts: List[int]        # (G + 1) offsets into row_ids
    seg_slots: List[int]         # (G) the device slot of each segment's adapter
    num_rows: int                # T, the step's rows (checked against x)
    all_rows: Optional[int]      # the slot when one adapter covers every row in order (no gather needed)

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
        return cls(torch.tensor(ids, dtype=torch.int64, device=device), starts, slots, len(row_slots), only)


def lora_delta_ref(x: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor,
                   row_slots: torch.Tensor) -> torch.Tensor:
    """Reference: the delta (T, N) in float32, row by row through gathered weights.
    row_slots: (T,) int64, -1 for a row without an adapter."""
    has = row_slots >= 0
    idx = row_slots.clamp(min=0)
    a = a_stack.float()[idx]                   # (T, R, K)
    b = b_stack.float()[idx]                   # (T, N, R)
    t = torch.bmm(a, x.float().unsqueeze(2))   # (T, R, 1): A x
    d = torch.bmm(b, t).squeeze(2)             # (T, N):    B (A x)
    return d * has.unsqueeze(1).to(d.dtype)


def lora_add_grouped(y: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor,
                     seg: LoRASegments, ranks: Optional[List[int]] = None) -> torch.Tensor:
    """The CPU path: y += delta in place, one GEMM pair per segment (adapter), no per-row loop.
    ranks[g] (optional): the rank segment g's adapter uses in this module (0 = none; the zero
    padding past it is skipped). Returns y."""
    assert x.shape[0] == seg.num_rows == y.shape[0], (x.shape, y.shape, seg.num_rows)
    for g, slot in enumerate(seg.seg_slots):
        r = a_stack.shape[1] if ranks is None else ranks[g]
        if r == 0:
            continue
        a, b = a_stack[slot, :r], b_stack[slot, :, :r]
        if seg.all_rows is not None:
            y += (x @ a.t()) @ b.t()
            continue
        rows = seg.row_ids[seg.seg_starts[g]:seg.seg_starts[g + 1]]
        y.index_add_(0, rows, (x[rows] @ a.t()) @ b.t())
    return y
