"""Static decode buffers per batch-size bucket, and CUDA graphs captured over them at load.

A pure decode step (one new token per sequence, no block copies, no LoRA) of B sequences runs
on the smallest bucket b >= B of BUCKETS (1, 2, 4, 8, 16, 32, then steps of 32 up to the
largest). Every bucket reads the same fixed device buffers (ids, positions, slots, context
lengths, block tables): the step writes its B rows there and fills rows B..b-1 with padding
that cannot touch the KV cache or the outputs:
- a padding row's K/V goes to a scratch block the runner keeps beyond the block manager's
  blocks (slot = scratch_block * block_size), never to a block a sequence owns;
- it attends over that one slot (context length 1), so it reads finite values only;
- its logits row is computed and dropped (the step returns rows :B).
On CUDA each bucket is captured once as a torch.cuda.CUDAGraph (after a warm-up on a side
stream; kernels compile then, never while serving), with the context bound fixed at the
engine's max_seq_len so that the graph's launch grid never changes; a step copies its inputs into
the buffers and replays the graph. On CPU the same buffers and padding run eagerly, so this
path is tested everywhere (tests/test_device_step.py); it is off by default there because the
padded rows cost CPU time.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import numpy as np
import torch

from tritium.kernels import ops
from tritium.kernels.attention_metadata import AttentionMetadata
from .device_step import PersistentTable, Stager
from .step_arrays import StepArrays


def buckets(max_batch: int) -> List[int]:
    """Batch sizes captured: powers of two to 32, then multiples of 32, and max_batch itself."""
    out = [b for b in (1, 2, 4, 8, 16, 32) if b < max_batch]
    out += list(range(64, max_batch, 32))
    return out + [max_batch]


class StaticDecode:
    """Runs pure decode steps on static buffers; captures CUDA graphs when `use_graphs`."""

    def __init__(self, runner, max_batch: int, use_graphs: bool):
        if max_batch < 1:
            raise ValueError(f"max_graph_batch must be >= 1, got {max_batch}")
        self.runner = runner
        self.device = runner.device
        self.buckets = buckets(max_batch)
        self.max_batch = max_batch
        self.use_graphs = use_graphs and self.device.type == "cuda"
        bs = runner.block_size
        self.scratch_slot = runner.scratch_block * bs
        # Wide enough for a full-length sequence plus a speculative proposal's blocks.
        width = -(-runner.cfg.limits.max_seq_len // bs) + 2
        dev = self.device
        self.input_ids = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((max_batch,), self.scratch_slot, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(max_batch, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=dev)
        self.tables = PersistentTable(dev, max_batch, width, fixed=True)
        self.tables.table.fill_(runner.scratch_block)
        self.tables.mirror.fill(runner.scratch_block)
        self.stager = Stager(dev)
        self.graphs: Dict[int, tuple] = {}  # bucket -> (CUDAGraph, static logits)
        self.num_steps = 0        # decode steps run on the static buffers
        self.num_replays = 0      # of them, CUDA graph replays
        self.num_padded_rows = 0

    # ------------------------------------------------------------------ eligibility
    def bucket_for(self, a: StepArrays, lora_active: bool) -> Optional[int]:
        """The bucket of a pure decode step, or None when the step must run eagerly."""
        b = a.seq_lens.shape[0]
        if lora_active or b > self.max_batch or a.block_copies.shape[0] or a.input_ids.shape[0] != b:
            return None
        if a.logit_rows.shape[0] != b or a.block_tables.shape[1] > self.tables.table.shape[1]:
            return None
        return next(x for x in self.buckets if x >= b)

    # ------------------------------------------------------------------ one step
    def _meta(self, b: int, seq_lens_cpu: List[int], max_seq_len: int) -> AttentionMetadata:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:b], query_start_loc=self.query_start_loc[:b + 1],
            seq_lens=self.seq_lens[:b], block_tables=self.tables.table[:b], query_lens_cpu=[1] * b,
            seq_lens_cpu=seq_lens_cpu, max_query_len=1, max_seq_len=max_seq_len,
            deterministic=self.runner.cfg.deterministic)
        meta.cpu_plan = ops.attention_plan(meta)
        return meta

    def _forward(self, b: int, meta: AttentionMetadata) -> torch.Tensor:
        model = self.runner.model
        hidden = model(self.input_ids[:b], self.positions[:b], self.runner.kv_caches, meta)
        return model.compute_logits(hidden).float()

    def _load(self, a: StepArrays, b: int) -> None:
        """The step's B rows into the static buffers, padding rows B..b-1 (see module doc)."""
        n = a.seq_lens.shape[0]
        pad = b - n
        tables = a.block_tables
        if pad or tables.shape[1] < self.tables.table.shape[1]:
            full = np.full((b, self.tables.table.shape[1]), self.runner.scratch_block, dtype=np.int32)
            full[:n, :tables.shape[1]] = tables
            tables = full
        entries = self.tables.changes(tables)
        zeros = np.zeros(pad, dtype=np.int64)
        ids, pos, slots, lens, flat = self.stager.send([
            np.concatenate([a.input_ids, zeros]), np.concatenate([a.positions, zeros]),
            np.concatenate([a.slot_mapping, np.full(pad, self.scratch_slot, dtype=np.int64)]),
            np.concatenate([a.seq_lens.astype(np.int64), np.ones(pad, dtype=np.int64)]), entries])
        self.input_ids[:b].copy_(ids, non_blocking=True)
        self.positions[:b].copy_(pos, non_blocking=True)
        self.slot_mapping[:b].copy_(slots, non_blocking=True)
        self.seq_lens[:b].copy_(lens, non_blocking=True)
        self.tables.apply(flat.view(3, -1))
        self.num_padded_rows += pad

    def run(self, a: StepArrays, b: int) -> torch.Tensor:
        """Logits (B, V) float32 of a pure decode step on bucket b (rows in batch order)."""
        n = a.seq_lens.shape[0]
        self._load(a, b)
        self.num_steps += 1
        if self.use_graphs and b in self.graphs:
            graph, logits = self.graphs[b]
            graph.replay()
            self.num_replays += 1
        else:
            lens = a.seq_lens.tolist() + [1] * (b - n)
            logits = self._forward(b, self._meta(b, lens, max(lens)))
        return logits[:n]

    # ------------------------------------------------------------------ capture (CUDA)
    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture one CUDA graph per bucket (largest first, one memory pool).
        The graphs bound contexts by the engine's max_seq_len: the decode kernel's split count
        is then the same at every step."""
        if not self.use_graphs:
            return
        limit = self.runner.cfg.limits.max_seq_len
        pool = None
        for b in sorted(self.buckets, reverse=True):
            meta = self._meta(b, [limit] * b, limit)  # padding contents: every row a scratch row
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._forward(b, meta)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=pool):
                    logits = self._forward(b, meta)
            except Exception as e:
                raise RuntimeError(f"cuda_graphs: capturing the decode step of batch {b} failed "
                                   f"({type(e).__name__}: {e}); load with cuda_graphs false") from e
            pool = graph.pool()
            self.graphs[b] = (graph, logits)
        torch.cuda.synchronize(self.device)
