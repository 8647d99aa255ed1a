"""Attention over a paged KV cache: the plain-torch reference (the test oracle).

The CPU production path is attention_cpu.py; the Triton kernels attention_prefill_triton.py and
attention_decode_triton.py.

Layouts:
    q:        (T, Hq, D)   new tokens of all sequences, packed (cu_seqlens = query_start_loc)
    k_cache:  (num_blocks, block_size, Hkv, D), v_cache the same
    block_tables: (B, max_blocks) physical block ids per sequence
Query token i of a sequence sits at absolute position p_i = seq_len - query_len + i and attends
to keys j with j <= p_i and, with a sliding window W, p_i - j < W.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .kv_write_ref import dequantize_kv_ref


def gather_kv_ref(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Contiguous (seq_len, Hkv, D) view of one sequence's cached K or V."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = cache[block_table[:num_blocks].long()]
    return blocks.reshape(num_blocks * block_size, *cache.shape[2:])[:seq_len]


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta,
                        scale: float, sliding_window: Optional[int] = None,
                        k_scale: Optional[torch.Tensor] = None,
                        v_scale: Optional[torch.Tensor] = None,
                        softcap: Optional[float] = None,
                        sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention of every new token over its sequence's cached context. Returns (T, Hq, D).
    With softcap, scores s = scale q.k become softcap * tanh(s / softcap) before the mask.
    With sinks (Hq,) (gpt-oss), head h's softmax denominator gains exp(sinks[h]): an extra logit
    that takes probability mass and contributes no value (p_j = exp(s_j) / (exp(sink) + sum exp(s)))."""
    out = torch.empty_like(q)
    hq = q.shape[1]
    qsl = meta.query_start_loc.tolist()
    for b, (qlen, slen) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        if qlen == 0:
            continue
        start = qsl[b]
        table = meta.block_tables[b]
        k = dequantize_kv_ref(gather_kv_ref(k_cache, table, slen), k_scale, q.dtype)
        v = dequantize_kv_ref(gather_kv_ref(v_cache, table, slen), v_scale, q.dtype)
        lo = 0
        if sliding_window is not None and qlen == 1:
            lo = max(0, slen - sliding_window)  # decode: just trim the window
        qb = q[start:start + qlen].transpose(0, 1)  # (Hq, qlen, D)
        kb = k[lo:].transpose(0, 1)
        vb = v[lo:].transpose(0, 1)
        mask = None
        if qlen > 1:
            qpos = torch.arange(slen - qlen, slen).unsqueeze(1)
            kpos = torch.arange(lo, slen).unsqueeze(0)
            allowed = kpos <= qpos
            if sliding_window is not None:
                allowed &= (qpos - kpos) < sliding_window
            mask = allowed
        if softcap is None and sinks is None:
            ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale,
                                                enable_gqa=kb.shape[0] != hq)
        else:
            ob = _softcapped_attention(qb, kb, vb, mask, scale, softcap, sinks)
        out[start:start + qlen] = ob.transpose(0, 1)
    return out


def _softcapped_attention(q, k, v, mask, scale: float, softcap: Optional[float],
                          sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q (Hq, n, D), k / v (Hkv, m, D): softmax(cap * tanh(scale q k^T / cap) + mask) v in float32
    (Gemma 2's attn_logit_softcapping; no cap when softcap is None); query head h reads KV head
    h // (Hq / Hkv). sinks (Hq,): one more logit per head in the softmax, dropped after it."""
    rep = q.shape[0] // k.shape[0]
    kf = k.float().repeat_interleave(rep, dim=0)
    vf = v.float().repeat_interleave(rep, dim=0)
    s = torch.matmul(q.float(), kf.transpose(1, 2)) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(s.softmax(dim=-1), vf).to(q.dtype)
    sink = sinks.float().view(-1, 1, 1).expand(-1, s.shape[1], 1)
    p = torch.cat([s, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return torch.matmul(p, vf).to(q.dtype)


