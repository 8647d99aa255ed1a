"""Per-step attention data, passed down the forward call as an argument (never a global)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch


@dataclass
class AttentionMetadata:
    """Describes one forward step over a flat batch of T new tokens from B sequences.

    Tokens of sequence b are rows query_start_loc[b]:query_start_loc[b+1] of q; they are the
    last `query_lens[b]` positions of a context of `seq_lens[b]` tokens whose K/V live in the
    paged cache at the blocks listed in block_tables[b].
    """
    slot_mapping: torch.Tensor     # (T,) int64: cache slot (block_id * block_size + offset) of each new token's K/V
    query_start_loc: torch.Tensor  # (B + 1,) int32: cumulative query lengths (cu_seqlens of q)
    seq_lens: torch.Tensor         # (B,) int32: context length of each sequence after this step
    block_tables: torch.Tensor     # (B, max_blocks_per_seq) int32: physical block ids, padded with 0
    query_lens_cpu: List[int]      # host copy of query lengths, so CPU loops never sync the device
    seq_lens_cpu: List[int]        # host copy of seq_lens
    max_query_len: int             # max(query_lens_cpu)
    max_seq_len: int               # max(seq_lens_cpu)
    # The step's CPU attention state (attention_cpu.CpuAttentionPlan: row lists, SDPA groups,
    # gather buffers), shared by the layers; set by the runner (ops.attention_plan), None on GPU.
    cpu_plan: Optional[object] = None
    # The step's split into decode and prefill rows for the Triton kernels (attention_split.py),
    # device index tensors built once per step; None on CPU, or built at the first layer.
    split: Optional[object] = None
    # EngineConfig.deterministic: every query row through the decode kernel on the Triton side too
    # (the CPU path is batch-invariant either way; docs/determinism.md)
    deterministic: bool = False

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @classmethod
    def build(cls, query_lens: List[int], seq_lens: List[int], block_tables: List[List[int]],
              block_size: int, device="cpu") -> "AttentionMetadata":
        """Build metadata from host lists; slot_mapping is derived from the block tables."""
        assert len(query_lens) == len(seq_lens) == len(block_tables)
        slots: List[int] = []
        for q, s, table in zip(query_lens, seq_lens, block_tables):
            for pos in range(s - q, s):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        max_blocks = max((len(t) for t in block_tables), default=1) or 1
        padded = [list(t) + [0] * (max_blocks - len(t)) for t in block_tables]
        qsl = [0]
        for q in query_lens:
            qsl.append(qsl[-1] + q)
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
            query_lens_cpu=list(query_lens),
            seq_lens_cpu=list(seq_lens),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
        )
