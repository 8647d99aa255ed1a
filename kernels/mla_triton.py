"""Triton paged attention for multi-head latent attention (MLA), absorbed form (contract and torch
reference: kernels/mla_ref.py).

One program per (query row, block of BLOCK_H heads): the row's context (its sequence's latent rows
up to and including its own position, causal) is read tile by tile from the paged cache once for
all the heads of the block (MLA's cache row is shared by every head, the way MQA's single KV head
is), scores = q_latent . c_kv + q_pe . k_pe as two dots, an online softmax (FlashAttention's
running max and sum), and the weighted sum of c_kv in float32. Decode rows and the rows of short
chunks go in the same launch; a row re-reads its context (no query tiling: long prompts take
the expanded form instead, backend/models/mla_prefill.py).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .triton_common import dot_upcast, mm


@triton.jit
def _mla_kernel(q_ptr, cache_ptr, bt_ptr, row_seq_ptr, row_ctx_ptr, out_ptr, scale_log2,
                stride_qt, stride_qh, stride_cb, stride_cs, stride_bt, stride_ot, stride_oh,
                num_heads, RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_R: tl.constexpr,
                BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                PAGE: tl.constexpr, IEEE: tl.constexpr):
    t = tl.program_id(0)
    s = tl.load(row_seq_ptr + t).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < num_heads
    r = tl.arange(0, BLOCK_R)
    rmask = r < RANK
    p = tl.arange(0, BLOCK_P)
    pmask = p < ROPE
    q_row = q_ptr + t * stride_qt + heads[:, None] * stride_qh
    q_lat = tl.load(q_row + r[None, :], mask=hmask[:, None] & rmask[None, :], other=0.0)
    q_pe = tl.load(q_row + RANK + p[None, :], mask=hmask[:, None] & pmask[None, :], other=0.0)
    if IEEE:  # fp32 operands (float32 engines, and bf16 under the interpreter: triton_common.dot_upcast)
        q_lat = q_lat.to(tl.float32)
        q_pe = q_pe.to(tl.float32)
    seq_len = tl.load(row_ctx_ptr + t)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for start in range(0, seq_len, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        nmask = n < seq_len
        blk = tl.load(bt_ptr + s * stride_bt + n // PAGE, mask=nmask, other=0).to(tl.int64)
        row = cache_ptr + blk * stride_cb + (n % PAGE) * stride_cs
        c = tl.load(row[:, None] + r[None, :], mask=nmask[:, None] & rmask[None, :], other=0.0)
        kp = tl.load(row[:, None] + RANK + p[None, :], mask=nmask[:, None] & pmask[None, :], other=0.0)
        if IEEE:
            c = c.to(tl.float32)
            kp = kp.to(tl.float32)
        scores = mm(q_lat, tl.trans(c), IEEE) + mm(q_pe, tl.trans(kp), IEEE)
        scores = tl.where(nmask[None, :], scores * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        pr = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(pr, 1)
        acc = acc * alpha[:, None] + mm(pr.to(c.dtype), c, IEEE)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + t * stride_ot + heads[:, None] * stride_oh + r[None, :], out.to(out_ptr.dtype.element_ty),
             mask=hmask[:, None] & rmask[None, :])


def _rows(meta, device):
    """Per query row: its sequence and its context length (the keys it may see); built once per
    step and kept on the step's metadata object, which every layer shares."""
    rows = getattr(meta, "_mla_rows", None)
    if rows is None or rows[0].device != device:
        seq = [b for b, ql in enumerate(meta.query_lens_cpu) for _ in range(ql)]
        ctx = [sl - ql + j + 1 for ql, sl in zip(meta.query_lens_cpu, meta.seq_lens_cpu) for j in range(ql)]
        rows = (torch.tensor(seq, dtype=torch.int32, device=device), torch.tensor(ctx, dtype=torch.int32, device=device))
        meta._mla_rows = rows
    return rows


def mla_attention(q: torch.Tensor, latent_cache: torch.Tensor, meta, scale: float, rank: int) -> torch.Tensor:
    """q (T, H, rank + rope), the rows of meta's sequences (prompt and decode rows alike);
    latent_cache (num_blocks, block_size, 1, rank + rope) -> (T, H, rank), causal per sequence.
    float32 inputs take IEEE dots (no TF32); bf16 dots accumulate in float32 (upcast under the
    interpreter, whose bf16 dot is wrong)."""
    t, h, d = q.shape
    if t != sum(meta.query_lens_cpu):
        raise ValueError(f"mla_attention: q has {t} rows, the metadata {sum(meta.query_lens_cpu)}")
    if latent_cache.dim() != 4 or latent_cache.shape[2] != 1 or latent_cache.shape[3] != d:
        raise ValueError(f"latent_cache: expected (num_blocks, block_size, 1, {d}), got {tuple(latent_cache.shape)}")
    row_seq, row_ctx = _rows(meta, q.device)
    q = q.contiguous()
    cache = latent_cache.contiguous()
    out = torch.empty(t, h, rank, dtype=q.dtype, device=q.device)
    rope = d - rank
    block_h = 16
    grid = (t, triton.cdiv(h, block_h))
    bt = meta.block_tables.contiguous()
    _mla_kernel[grid](q, cache, bt, row_seq, row_ctx, out, scale * (1.0 / math.log(2.0)),
                      q.stride(0), q.stride(1), cache.stride(0), cache.stride(1), bt.stride(0),
                      out.stride(0), out.stride(1), h, RANK=rank, ROPE=rope,
                      BLOCK_R=max(16, triton.next_power_of_2(rank)),
                      BLOCK_P=max(16, triton.next_power_of_2(rope)), BLOCK_H=block_h, BLOCK_N=16,
                      PAGE=cache.shape[1], IEEE=q.dtype == torch.float32 or dot_upcast(q.dtype))
    return out
