"""In-flight batching scheduler with a per-step token budget (Orca-style iteration-level scheduling,
Yu et al., OSDI 2022; budget accounting after vLLM v1).

Every sequence tracks num_computed_tokens against num_tokens; each step spends at most
`max_num_batched_tokens` on the differences. Running sequences go first (a decode costs 1 token,
an unfinished prompt costs a chunk), then waiting ones are admitted while budget, `max_num_seqs`
and KV blocks allow. Chunked prefill falls out: a prompt larger than the remaining budget simply
computes part of itself this step. When a running sequence cannot get a block, the newest
(lowest-priority) running sequence is preempted: its blocks are freed and it is recomputed later
(prefix caching usually makes that cheap). Order is FCFS, or by `priority` (lower first) when set.
"""
from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import List, Tuple

from .block_manager import BlockManager, cdiv
from .sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    """What one engine step computes."""
    # Sequences to run this step, in batch order (their tokens are laid out in this order).
    seqs: List[Sequence] = field(default_factory=list)
    # How many new tokens each of `seqs` computes this step: a prompt chunk, or 1 for a decode
    # (1 + len(seq.spec_token_ids) for a decode that verifies a speculative proposal).
    num_new_tokens: List[int] = field(default_factory=list)
    # Copy-on-write block copies (src_block, dst_block) the runner must do before the forward.
    block_copies: List[Tuple[int, int]] = field(default_factory=list)
    # Running sequences preempted this step; their blocks are freed and they will be recomputed.
    preempted: List[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        """Total tokens in this step's batch; never more than max_num_batched_tokens."""
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


class Scheduler:
    """Decides, each step, which sequences compute how many tokens."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        if max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: List[Sequence] = []  # sorted by Sequence.sort_key
        self.running: List[Sequence] = []  # sorted by Sequence.sort_key (oldest / most important first)
        self.num_preemptions = 0
        self.max_loras = None  # LoRA: most distinct adapters in one step (backend/lora), None when off

    # ------------------------------------------------------------------ queues
    def add(self, seq: Sequence) -> None:
        """Queue a new (or preempted) sequence for admission."""
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    def _start_running(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=lambda s: s.sort_key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _slots_needed(self, seq: Sequence) -> int:
        # Sequence 0 of an n-sample request forks n - 1 siblings once its prompt is done.
        if seq.index != 0 or seq.request.params.n == 1:
            return 1
        return 1 + sum(1 for s in seq.request.seqs if s.status == SequenceStatus.PENDING_FORK)

    # ------------------------------------------------------------------ the step
    def schedule(self) -> SchedulerOutput:
        """Pick this step's batch under the token budget; preempt if blocks run out."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        now = time.monotonic()

        # 1) Running sequences, oldest first. Victims come off the end of `queue`.
        queue = list(self.running)
        i = 0
        while i < len(queue) and budget > 0:
            seq = queue[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            assert num_new > 0, f"running sequence with nothing to compute: {seq}"
            if seq.spec_token_ids:
                num_new += self._fit_proposal(seq, budget - num_new, reserve=len(queue) - i - 1)
            while not self.bm.can_append(seq, num_new):
                victim = queue.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                break  # seq preempted itself: nothing after it is left either
            out.block_copies += self.bm.append_slots(seq, num_new)
            out.seqs.append(seq)
            out.num_new_tokens.append(num_new)
            budget -= num_new
            i += 1

        # 2) Waiting sequences, in order, unless memory was just short (they would only thrash).
        # Running prompts of n > 1 requests hold slots for the samples they will fork.
        num_slots = sum(self._slots_needed(s) for s in self.running)
        loras = {s.request.lora.digest for s in self.running if s.request.lora is not None}
        while self.waiting and budget > 0 and not out.preempted:
            seq = self.waiting[0]
            need = self._slots_needed(seq)
            if num_slots + need > self.max_num_seqs:
                break
            lora = seq.request.lora
            if lora is not None and lora.digest not in loras:
                if self.max_loras is not None and len(loras) >= self.max_loras:
                    break  # its adapter waits for a device slot (FCFS)
                loras.add(lora.digest)
            computed = self.bm.get_computed_blocks(seq)
            num_cached = len(computed) * self.bm.block_size
            num_new = min(seq.num_tokens - num_cached, budget)
            if not self.bm.can_allocate(seq, num_new, computed):
                break  # FCFS: no overtaking of the head of the queue
            self.bm.allocate(seq, num_new, computed)
            self.waiting.pop(0)
            self._start_running(seq)
            num_slots += need
            m = seq.request.metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time = now
                m.num_cached_tokens = num_cached
            out.seqs.append(seq)
            out.num_new_tokens.append(num_new)
            budget -= num_new
        return out

    def _fit_proposal(self, seq: Sequence, budget: int, reserve: int) -> int:
        """Speculative decoding: a decoding sequence also computes its proposed tokens, as many as
        the token budget and the free blocks allow while `reserve` blocks stay free for the running
        sequences after it (so a proposal does not cause a preemption).
        Trims seq.spec_token_ids to what is scheduled; returns its length."""
        k = min(len(seq.spec_token_ids), max(budget, 0))
        if k:
            bm = self.bm
            have = max(len(seq.block_table), cdiv(seq.num_computed_tokens + 1, bm.block_size))
            extra = cdiv(seq.num_computed_tokens + 1 + k, bm.block_size) - have
            if extra > 0 and (not bm.can_append(seq, 1 + k) or bm.num_free_blocks - extra < reserve):
                # Only what fits in the blocks the decode itself needs.
                k = min(k, have * bm.block_size - seq.num_computed_tokens - 1)
        if k < len(seq.spec_token_ids):
            del seq.spec_token_ids[k:]
            if seq.spec_draft_probs is not None:
                seq.spec_draft_probs = seq.spec_draft_probs[:k] if k else None
        return k

    def _preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks and send it back to wait (recompute later)."""
        seq.spec_token_ids, seq.spec_draft_probs = [], None
        self.running.remove(seq)
        self.bm.free(seq)
        self.num_preemptions += 1
        seq.request.metrics.num_preemptions += 1
        self.add(seq)

    # ------------------------------------------------------------------ after the step
    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Start `child` as a copy of `parent` sharing its blocks (n > 1 sampling)."""
        self.bm.fork(parent, child)
        self._start_running(child)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark seq finished and release its blocks (cached full blocks stay reusable)."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.bm.free(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
            if seq.block_table:
                self.bm.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
