"""Multi-head latent attention (MLA, DeepSeek-V2 paper) over the paged latent cache, absorbed form:
the torch reference of kernels/mla_triton.py, and the contract of ops.mla_attention.

The cache holds per token one row [c_kv (kv_lora_rank) | k_pe (qk_rope_head_dim)], shape
(num_blocks, block_size, 1, rank + rope). A query arrives already absorbed, q = [q_nope W_UK^T |
q_pe] (T, H, rank + rope), so that score(t, j) = q[t] . row[j] = q_nope . k_nope + q_pe . k_pe;
the output is the softmax-weighted sum of the rows' latent part, (T, H, rank), which the caller
maps through W_UV. No per-head key or value is ever formed.
"""
from __future__ import annotations

import torch


def mla_attention_ref(q: torch.Tensor, latent_cache: torch.Tensor, meta, scale: float, rank: int) -> torch.Tensor:
    """q (T, H, rank + rope), latent_cache (num_blocks, block_size, 1, rank + rope) -> (T, H, rank),
    causal within each sequence of `meta` (kernels/attention_metadata.AttentionMetadata)."""
    t, h, d = q.shape
    bs = latent_cache.shape[1]
    flat = latent_cache.reshape(-1, d)
    out = q.new_empty(t, h, rank)
    tables = meta.block_tables.long()
    start = 0
    for i, (ql, sl) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        pos = torch.arange(sl, device=q.device)
        rows = flat[tables[i, pos // bs] * bs + pos % bs].float()  # (sl, rank + rope)
        qs = q[start:start + ql].float()
        scores = torch.einsum("qhd,kd->hqk", qs, rows) * scale
        qpos = torch.arange(sl - ql, sl, device=q.device)
        scores = scores.masked_fill(pos[None, :] > qpos[:, None], float("-inf"))
        p = torch.softmax(scores, dim=-1)
        out[start:start + ql] = torch.einsum("hqk,kr->qhr", p, rows[:, :rank]).to(q.dtype)
        start += ql
    return out
