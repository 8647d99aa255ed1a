"""The CPU decode step's inputs without per-step arrays: a fast path of ModelRunner.run.

A steady decode step of a few rows (one new token a sequence, no proposals, no block copies)
runs as one native call (backend/models/native_step.py) that reads seven int64 vectors (ids,
positions, slots and the attention rows) and a block table. Through prepare_arrays and inputs
a step builds them as fresh numpy arrays, torch tensors, an AttentionMetadata and an attention
plan, about 0.1 ms of Python a step on a 4 ms step. Here they live in buffers kept per row
count: a step writes its ids, positions, slots and lengths into one (3 + 4, T) int64 array, and
a block table row only when its sequence or its table's length changed since the last step
(any step that does not take this path forgets them). The call is the same
(NativeStep.run_step with logits=True, through DecoderLM.decode_logits), on the same values, so
the bits are the same; steps it does not take go the general way.
"""
from __future__ import annotations

from typing import List, Optional

import numpy as np
import torch

from .models.native_step import NATIVE_STEP_MAX_ROWS


class _Plan:
    """The native call's view of the step's attention (CpuAttentionPlan's block_tables and
    rows_for): every row a decode row of its own sequence."""

    def __init__(self, owner: "_Rows"):
        self.owner = owner

    @property
    def block_tables(self) -> torch.Tensor:
        return self.owner.tables_t

    def rows_for(self, meta, window: Optional[int]) -> torch.Tensor:
        return self.owner.rows_for(window)


class _Rows:
    """Buffers of one row count T. vec rows: 0 ids, 1 positions, 2 slots, then the attention rows'
    columns (3 row index, 4 sequence index, 5 first key, 6 key count)."""

    def __init__(self, t: int):
        self.t = t
        self.vec = np.zeros((7, t), dtype=np.int64)
        self.vec[3] = self.vec[4] = np.arange(t)
        v = torch.from_numpy(self.vec)
        self.ids, self.pos, self.slots = v[0], v[1], v[2]
        self.rows = v[3:7].t()  # (T, 4) whose transpose is contiguous: the call's columns as they are
        self.window = None  # the window vec[5] holds (None: zeros)
        self.tables = np.zeros((t, 1), dtype=np.int32)
        self.tables_t = torch.from_numpy(self.tables)
        self.held: List[Optional[list]] = [None] * t  # each row's block table list, as written
        self.lens = [0] * t
        self.block_tables = self.tables_t  # what NativeStep reads as meta.block_tables
        self.slot_mapping = self.slots
        self.cpu_plan = _Plan(self)

    def forget(self) -> None:
        self.held = [None] * self.t

    def set_tables(self, seqs) -> None:
        """Writes the block table rows that changed (another sequence, another list or length)."""
        width = max(len(s.block_table) for s in seqs)
        if width > self.tables.shape[1]:  # wider: a new array (the call reads its width as the row stride)
            self.tables = np.zeros((self.t, max(width, 2 * self.tables.shape[1])), dtype=np.int32)
            self.tables_t = self.block_tables = torch.from_numpy(self.tables)
            self.forget()
        held, lens, tables = self.held, self.lens, self.tables
        for i, s in enumerate(seqs):
            bt = s.block_table
            if bt is not held[i] or len(bt) != lens[i]:
                n = len(bt)
                tables[i, :n] = bt
                tables[i, n:] = 0
                held[i], lens[i] = bt, n

    def rows_for(self, window: Optional[int]) -> torch.Tensor:
        if window is not None:
            np.maximum(self.vec[6] - window, 0, out=self.vec[5])
        elif self.window is not None:
            self.vec[5] = 0
        self.window = window
        return self.rows


class NativeDecode:
    """ModelRunner's fast path for decode-only CPU steps of at most NATIVE_STEP_MAX_ROWS rows."""

    def __init__(self, runner):
        self.runner = runner
        self.block_size = runner.block_size
        self._rows = {}
        self._last: Optional[_Rows] = None

    def forget(self) -> None:
        if self._last is not None:
            self._last.forget()
            self._last = None

    def _fill(self, sched, allowed: bool) -> Optional[_Rows]:
        """The buffers of this step's row count holding its inputs, or None where the step does
        not take the path."""
        seqs = sched.seqs
        t = len(seqs)
        if (not allowed or not 0 < t <= NATIVE_STEP_MAX_ROWS or sched.block_copies
                or any(n != 1 for n in sched.num_new_tokens)):
            self.forget()
            return None
        bs = self.block_size
        ids, pos, slots = [], [], []
        for s in seqs:
            p = s.num_computed_tokens
            if p + 1 != s.num_tokens or s.spec_token_ids:
                self.forget()
                return None
            ids.append(s.token_ids[p])
            pos.append(p)
            slots.append(s.block_table[p // bs] * bs + p % bs)
        r = self._rows.get(t)
        if r is None:
            r = self._rows[t] = _Rows(t)
        if r is not self._last:
            self.forget()
            self._last = r
        r.vec[0:3] = (ids, pos, slots)
        np.add(r.vec[1], 1, out=r.vec[6])  # keys [0, position]
        r.set_tables(seqs)
        return r

    def run(self, sched, allowed: bool = True) -> Optional[torch.Tensor]:
        """float32 logits of every row (the runner's _argmax set as decode_logits returns it), or
        None where this step does not take the path (the caller runs the general one; `allowed`
        False: not this step, e.g. LoRA adapters in the engine)."""
        r = self._fill(sched, allowed)
        if r is None:
            return None
        runner = self.runner
        out = runner.model.decode_logits(r.ids, r.pos, runner.kv_caches, r)
        if out is None:
            self.forget()
            return None
        runner._argmax = out
        return out[0]

    def run_burst(self, sched, k: int, stop_ids: list) -> Optional[list]:
        """Up to k greedy decode steps of this step's rows in one call (backend/decode_burst.py;
        every row's blocks cover its next k tokens): each step's tokens (lists of T), or None
        where the step or the model does not take it."""
        if not hasattr(self.runner.model, "decode_burst"):
            return None
        r = self._fill(sched, True)
        if r is None:
            return None
        runner = self.runner
        out = runner.model.decode_burst(r.ids, r.pos, runner.kv_caches, r, k, stop_ids)
        if out is None:
            self.forget()
        return out
