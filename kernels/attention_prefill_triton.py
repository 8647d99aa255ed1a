"""Triton varlen prefill attention over the paged KV cache (FlashAttention-2 style).

Queries of all sequences are packed (cu_seqlens = query_start_loc); the K/V of every position,
earlier context and this step's tokens alike, are read from the paged cache (kv_write runs
first), so chunked prefill and prefix-cache reuse need no special case. Query i of a sequence
sits at p_i = seq_len - query_len + i and attends to keys j <= p_i with p_i - j < window.
Online softmax per FlashAttention-2 (Dao, 2023): one program per (sequence, query block, head),
rescaling the running accumulator as the row maximum grows. Reference: paged_attention_ref.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .attention_split import attention_split
from .attention_decode_triton import (LOG2E, check_paged_cache, check_softcap, load_kv_tile, paged_decode,
                                      sinks_log2, softcap)
from .triton_common import check_shape, dot_upcast, mm, next_pow2


@triton.jit
def _prefill_attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, seq_ids_ptr,
                              k_scale_ptr, v_scale_ptr, sinks_ptr, out_ptr,
                              stride_q_tok, stride_q_head, stride_c_block, stride_c_slot, stride_c_head,
                              stride_bt_seq, stride_o_tok, stride_o_head,
                              scale_log2, block_size, head_dim, group, window, softcap_log2,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                              KV_QUANT: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                              HAS_SINKS: tl.constexpr):
    seq = tl.load(seq_ids_ptr + tl.program_id(0)).to(tl.int64)
    m_blk = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2).to(tl.int64)
    kv_head = head // group
    q_start = tl.load(qsl_ptr + seq).to(tl.int64)
    q_len = tl.load(qsl_ptr + seq + 1).to(tl.int64) - q_start
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int64)
    if m_blk * BLOCK_M < q_len:
        rows = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < q_len
        q_pos = seq_len - q_len + rows  # absolute position of each query row
        d = tl.arange(0, BLOCK_D)
        dmask = d < head_dim
        q = tl.load(q_ptr + (q_start + rows)[:, None] * stride_q_tok + head * stride_q_head + d[None, :],
                    mask=rmask[:, None] & dmask[None, :], other=0.0)
        cdt = q.dtype
        if UPCAST:
            cdt = tl.float32
        q = q.to(cdt)
        bt_row = bt_ptr + seq * stride_bt_seq
        # keys needed by this block: [first row's window start, last row's position]
        first_pos = seq_len - q_len + m_blk * BLOCK_M
        hi = tl.minimum(first_pos + BLOCK_M, seq_len)
        lo = tl.where(window > 0, tl.maximum(first_pos - window + 1, 0), 0)

        m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l = tl.zeros((BLOCK_M,), tl.float32)
        if HAS_SINKS:
            # gpt-oss: the head's sink logit starts the online softmax as a key with no value:
            # m = sink, l = exp(sink - m) = 1, acc = 0 (log2 units)
            m = tl.full((BLOCK_M,), 0.0, tl.float32) + tl.load(sinks_ptr + head)
            l = l + 1.0
        acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        for n0 in range(lo, hi, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            pmask = pos < hi
            k = load_kv_tile(k_cache_ptr, bt_row, k_scale_ptr, pos, pmask, kv_head, d, dmask,
                             stride_c_block, stride_c_slot, stride_c_head, block_size, cdt, KV_QUANT)
            # s = q . k * scale (log2 units); causal: key j <= p_i; window: p_i - j < W
            s = mm(q, tl.trans(k), IEEE) * scale_log2
            if softcap_log2 > 0:  # Gemma 2: cap * tanh(s / cap), before the mask
                s = softcap(s, softcap_log2)
            allowed = pmask[None, :] & (pos[None, :] <= q_pos[:, None])
            if window > 0:
                allowed = allowed & ((q_pos[:, None] - pos[None, :]) < window)
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            # rows with nothing allowed yet keep m = -inf; subtract 0 there to avoid inf - inf
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m - m_safe)
            v = load_kv_tile(v_cache_ptr, bt_row, v_scale_ptr, pos, pmask, kv_head, d, dmask,
                             stride_c_block, stride_c_slot, stride_c_head, block_size, cdt, KV_QUANT)
            l = l * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + mm(p.to(cdt), v, IEEE)
            m = m_new
        out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
        tl.store(out_ptr + (q_start + rows)[:, None] * stride_o_tok + head * stride_o_head + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                      max_query_len: int, scale: float, sliding_window: Optional[int] = None,
                      k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None,
                      seq_ids: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
                      block_m: Optional[int] = None, block_n: Optional[int] = None,
                      softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention of packed queries q (T, Hq, D) over each sequence's paged context.
    softcap: scores s -> softcap * tanh(s / softcap) before the mask (None: none).
    sinks: (Hq,) per-head logits in every softmax's denominator (gpt-oss; None: none).

    query_start_loc (B+1,) int32 cu_seqlens; seq_lens (B,) context length after this step (the new
    tokens' K/V already written to the cache); block_tables (B, max_blocks). seq_ids (int32) picks
    the sequences to compute (default all); rows of other sequences in `out` are left untouched.
    Returns/fills out (T, Hq, D).
    """
    kv_quant = check_paged_cache(q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale)
    t, hq, d = q.shape
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    check_shape("query_start_loc", query_start_loc, (num_seqs + 1,))
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window: must be > 0 or None, got {sliding_window}")
    check_softcap(softcap)
    sinks = sinks_log2(sinks, q)
    if out is None:
        out = torch.empty_like(q)
    check_shape("out", out, (t, hq, d))
    if seq_ids is None:
        seq_ids = torch.arange(num_seqs, dtype=torch.int32, device=q.device)
    if t == 0 or seq_ids.numel() == 0 or max_query_len <= 0:
        return out
    upcast = dot_upcast(q.dtype)
    block_d = next_pow2(d)
    # 64x64 tiles fit H100 shared memory up to head_dim 128 in bf16; smaller for tiny prompts
    block_m = block_m or max(16, min(64, next_pow2(max_query_len)))
    block_n = block_n or 64
    # q/out: (T, Hq, D) packed by query_start_loc; caches: (num_blocks, block_size, Hkv, D).
    # Grid: (sequence, query block, query head).
    grid = (seq_ids.numel(), triton.cdiv(max_query_len, block_m), hq)
    _prefill_attention_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, seq_ids,
        k_scale if kv_quant else q, v_scale if kv_quant else q, q if sinks is None else sinks, out,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        float(scale) * LOG2E, block_size, d, hq // hkv, int(sliding_window or 0), float(softcap or 0.0) * LOG2E,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, KV_QUANT=kv_quant, UPCAST=upcast,
        IEEE=upcast or q.dtype == torch.float32, HAS_SINKS=sinks is not None, num_warps=4 if block_d <= 64 else 8)
    return out


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta, scale: float,
                    sliding_window: Optional[int] = None, k_scale: Optional[torch.Tensor] = None,
                    v_scale: Optional[torch.Tensor] = None, softcap: Optional[float] = None,
                    sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Mixed prefill/decode batch (AttentionMetadata) -> (T, Hq, D), like paged_attention_ref.

    Sequences with query_len == 1 go to the split-K decode kernel, the others to the varlen
    prefill kernel. The split's index tensors (meta.split, attention_split.py) are built once
    per step from the host copies of the lengths, so the layers never copy to the device or sync.
    With meta.deterministic every query token is a row of the decode kernel over its own keys, so
    a row gets the same bits in a prefill, a chunk, a verification or a decode (docs/determinism.md).
    """
    split = getattr(meta, "split", None)
    if split is None:  # a caller that did not build the step's split: once, kept on meta
        split = attention_split(meta)
        try:
            meta.split = split
        except AttributeError:
            pass
    out = torch.empty_like(q)
    if getattr(meta, "deterministic", False):
        if split.row_lens is None:
            return out
        return paged_decode(q, k_cache, v_cache, split.row_tables, split.row_lens, scale, sliding_window,
                            k_scale, v_scale, max_seq_len=split.row_max_len, out=out, softcap=softcap, sinks=sinks)
    if split.num_decode:
        if split.num_decode == q.shape[0]:
            paged_decode(q, k_cache, v_cache, split.decode_tables, split.decode_lens, scale, sliding_window,
                         k_scale, v_scale, max_seq_len=split.decode_max_len, out=out, softcap=softcap,
                         sinks=sinks)
        else:
            rows = split.decode_rows
            dec_out = paged_decode(q.index_select(0, rows), k_cache, v_cache, split.decode_tables,
                                   split.decode_lens, scale, sliding_window, k_scale, v_scale,
                                   max_seq_len=split.decode_max_len, softcap=softcap,
                                   sinks=sinks)
            out.index_copy_(0, rows, dec_out)
    if split.prefill_ids is not None:
        prefill_attention(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                          split.prefill_max_query_len, scale, sliding_window, k_scale, v_scale,
                          seq_ids=split.prefill_ids, out=out, softcap=softcap, sinks=sinks)
    return out
