"""Prompt rows of multi-head latent attention in the expanded form (backend/models/mla.py).

The absorbed form costs 2 kv_lora_rank - qk_nope_head_dim - v_head_dim more multiply-adds per
query, key and head than attention over expanded keys and values; expanding a sequence's cached
latents through kv_b_proj costs kv_lora_rank (qk_nope_head_dim + v_head_dim) per key and head,
paid once for all the sequence's new rows. So the rows of a sequence with at least
expand_min_rows new tokens (a prompt, or a long prompt chunk) expand their context and run causal
SDPA per head; decode rows (and short chunks, speculative verification) stay absorbed and never
form per-head K or V. docs/benchmarks.md has the CPU measurement behind this.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from tritium.kernels import ops
from tritium.kernels.attention_metadata import AttentionMetadata


def expand_min_rows(rank: int, nope: int, v: int) -> float:
    """New rows of one sequence from which expanding its context costs fewer multiply-adds."""
    extra = 2 * rank - nope - v
    return math.inf if extra <= 0 else math.ceil(rank * (nope + v) / extra)


@dataclass
class RowSplit:
    absorbed_rows: Optional[torch.Tensor]  # (n,) row indices of the absorbed rows; None: every row
    absorbed_meta: Optional[AttentionMetadata]  # their sequences' metadata (None: no absorbed row)
    expanded: List[Tuple[int, int, int, int]]  # (first row, new rows, context length, sequence)


def row_split(meta, min_rows: float, block_size: int) -> RowSplit:
    """Which rows expand; built once per step and kept on the step's metadata (shared by layers)."""
    split = getattr(meta, "_mla_split", None)
    if split is not None:
        return split
    starts, expanded, kept = 0, [], []
    for b, (ql, sl) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        (expanded if ql >= min_rows else kept).append((starts, ql, sl, b))
        starts += ql
    if not expanded:
        split = RowSplit(None, meta, [])
    elif not kept:
        split = RowSplit(None, None, expanded)
    else:
        dev = meta.block_tables.device
        tables = meta.block_tables.tolist()
        sub = AttentionMetadata.build([ql for _, ql, _, _ in kept], [sl for _, _, sl, _ in kept],
                                      [tables[b] for *_, b in kept], block_size, dev)
        sub.deterministic = meta.deterministic
        sub.cpu_plan = ops.attention_plan(sub)
        rows = torch.cat([torch.arange(s, s + ql) for s, ql, _, _ in kept]).to(dev)
        split = RowSplit(rows, sub, expanded)
    meta._mla_split = split
    return split


def expanded_attention(q: torch.Tensor, latent_cache: torch.Tensor, kv_b: torch.Tensor, meta, b: int, ql: int,
                       sl: int, rank: int, nope: int, scale: float) -> torch.Tensor:
    """q (ql, H, nope + rope) of sequence b's last ql positions -> (ql, H, v): its sl cached
    latents expanded through kv_b (H (nope + v), rank) into per-head K and V, causal SDPA."""
    h, d = q.shape[1], latent_cache.shape[-1]
    bs = latent_cache.shape[1]
    pos = torch.arange(sl, device=q.device)
    rows = latent_cache.reshape(-1, d)[meta.block_tables[b, pos // bs].long() * bs + pos % bs]
    kv = F.linear(rows[:, :rank], kv_b).view(sl, h, -1)
    k = torch.cat([kv[..., :nope], rows[:, None, rank:].expand(sl, h, d - rank)], dim=-1)
    mask = None if ql == sl else pos[None, :] <= (sl - ql + torch.arange(ql, device=q.device))[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), kv[..., nope:].transpose(0, 1),
                                         attn_mask=mask, is_causal=mask is None, scale=scale)
    return out.transpose(0, 1)
