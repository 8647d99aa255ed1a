"""The per-step split of a mixed batch for the Triton attention kernels, built once per step.

paged_attention (attention_prefill_triton.py) sends sequences with one query token to the split-K
decode kernel and the others to the varlen prefill kernel. The index tensors that split needs
are made here from the host copies of the lengths, once per step (the runner calls it while
building the step's metadata), so the layer loop makes no host -> device copy and no host sync:
every layer reuses the same device tensors (meta.split).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class AttentionSplit:
    """Device index tensors of one step (None where that part of the batch is empty)."""
    num_decode: int                              # sequences with query_len == 1
    all_decode: bool                             # every sequence decodes: no gather needed
    decode_rows: Optional[torch.Tensor]          # (Bd,) int64 query rows of the decode sequences
    decode_tables: Optional[torch.Tensor]        # (Bd, max_blocks) their block tables
    decode_lens: Optional[torch.Tensor]          # (Bd,) their context lengths
    decode_max_len: int                          # max context length among them (host int)
    prefill_ids: Optional[torch.Tensor]          # (Bp,) int32 sequences with query_len > 1
    prefill_max_query_len: int                   # max query length among them (host int)
    # meta.deterministic: every query token as a decode row over its own keys
    row_tables: Optional[torch.Tensor] = None    # (T, max_blocks)
    row_lens: Optional[torch.Tensor] = None      # (T,) int32
    row_max_len: int = 0


def _index(values, dtype, device) -> torch.Tensor:
    t = torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def attention_split(meta) -> AttentionSplit:
    """AttentionSplit of an AttentionMetadata (host lists -> device index tensors, once)."""
    qlens, slens = meta.query_lens_cpu, meta.seq_lens_cpu
    dev = meta.block_tables.device
    decode = [b for b, n in enumerate(qlens) if n == 1]
    prefill = [b for b, n in enumerate(qlens) if n > 1]
    all_decode = len(decode) == len(qlens)
    rows = tables = lens = None
    if decode and all_decode:
        rows, tables, lens = meta.query_start_loc[:-1].long(), meta.block_tables, meta.seq_lens
    elif decode:
        idx = _index(decode, torch.int64, dev)
        rows = meta.query_start_loc[:-1].index_select(0, idx).long()
        tables, lens = meta.block_tables.index_select(0, idx), meta.seq_lens.index_select(0, idx)
    split = AttentionSplit(
        num_decode=len(decode), all_decode=all_decode, decode_rows=rows, decode_tables=tables,
        decode_lens=lens, decode_max_len=max((slens[b] for b in decode), default=0),
        prefill_ids=_index(prefill, torch.int32, dev) if prefill else None,
        prefill_max_query_len=max((qlens[b] for b in prefill), default=0))
    if getattr(meta, "deterministic", False) and all_decode:
        # One row per sequence: its own table and length (no copy, so a captured CUDA graph
        # reads the step's tables, not those of the capture).
        split.row_tables, split.row_lens, split.row_max_len = meta.block_tables, meta.seq_lens, split.decode_max_len
    elif getattr(meta, "deterministic", False):
        seq_of_row, row_lens = [], []
        for b, (n, s) in enumerate(zip(qlens, slens)):
            seq_of_row.extend([b] * n)
            row_lens.extend(range(s - n + 1, s + 1))
        if row_lens:
            split.row_tables = meta.block_tables.index_select(0, _index(seq_of_row, torch.int64, dev))
            split.row_lens = _index(row_lens, torch.int32, dev)
            split.row_max_len = max(row_lens)
    return split
