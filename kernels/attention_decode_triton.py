"""Triton paged decode attention: one query token per sequence over its paged KV cache.

Flash-decoding (Dao et al., "Flash-Decoding for long-context inference"): the context is split
into partitions processed in parallel, each keeping an online-softmax state (max m, sum l,
unnormalised acc); a second kernel merges the partitions. GQA/MQA: each program serves all the
query heads of one KV head, so K/V tiles are read once per group. FP8/INT8 caches are
dequantized with per-KV-head scales as tiles are loaded. Reference: paged_attention_ref.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .triton_common import (TORCH_FLOATS, check_device, check_dtype, check_last_contiguous, check_shape, dot_upcast,
                            mm, next_pow2)

LOG2E = 1.4426950408889634


@triton.jit
def load_kv_tile(cache_ptr, bt_row_ptr, scale_ptr, pos, pmask, kv_head, d, dmask,
                 stride_c_block, stride_c_slot, stride_c_head, block_size,
                 OUT_DTYPE: tl.constexpr, KV_QUANT: tl.constexpr):
    """(BLOCK_N, BLOCK_D) tile of K or V for absolute positions `pos`, dequantized to OUT_DTYPE."""
    # slot of position p: block_table[p // block_size] * block_size + p % block_size
    blk = tl.load(bt_row_ptr + pos // block_size, mask=pmask, other=0).to(tl.int64)
    offs = blk * stride_c_block + (pos % block_size).to(tl.int64) * stride_c_slot + kv_head * stride_c_head
    x = tl.load(cache_ptr + offs[:, None] + d[None, :], mask=pmask[:, None] & dmask[None, :], other=0.0)
    if KV_QUANT:
        # dequantize: x * scale[kv_head], rounded to the compute dtype like dequantize_kv_ref
        x = (x.to(tl.float32) * tl.load(scale_ptr + kv_head)).to(OUT_DTYPE)
    else:
        x = x.to(OUT_DTYPE)
    return x


@triton.jit
def softcap(s, cap):
    """cap * tanh(s / cap) (Gemma 2's attn_logit_softcapping; s and cap both in log2 units, which
    commutes: c * tanh(x / c) scaled by LOG2E is (c LOG2E) tanh(x LOG2E / (c LOG2E))).
    tanh(x) = 2 sigmoid(2x) - 1."""
    return cap * (2.0 * tl.sigmoid(2.0 * s / cap) - 1.0)


@triton.jit
def _paged_decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, seq_lens_ptr, k_scale_ptr, v_scale_ptr,
                         out_ptr, part_acc_ptr, part_ml_ptr,
                         stride_q_seq, stride_q_head, stride_c_block, stride_c_slot, stride_c_head,
                         stride_bt_seq, stride_o_seq, stride_o_head,
                         scale_log2, block_size, head_dim, group, window, num_splits, softcap_log2,
                         PARTITION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
                         BLOCK_D: tl.constexpr, KV_QUANT: tl.constexpr, USE_SPLIT: tl.constexpr,
                         UPCAST: tl.constexpr, IEEE: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int64)
    # with a window W the query at seq_len-1 sees keys j > seq_len-1-W
    lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    start = tl.maximum(split * PARTITION, lo)
    end = tl.minimum(split * PARTITION + PARTITION, seq_len)

    g = tl.arange(0, BLOCK_G)
    heads = kv_head * group + g
    gmask = g < group
    d = tl.arange(0, BLOCK_D)
    dmask = d < head_dim
    q = tl.load(q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)
    cdt = q.dtype
    if UPCAST:
        cdt = tl.float32
    q = q.to(cdt)
    bt_row = bt_ptr + seq * stride_bt_seq

    m = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pmask = pos < end
        k = load_kv_tile(k_cache_ptr, bt_row, k_scale_ptr, pos, pmask, kv_head, d, dmask,
                         stride_c_block, stride_c_slot, stride_c_head, block_size, cdt, KV_QUANT)
        # s = q . k * scale, in log2 units so that exp2 gives exp
        s = mm(q, tl.trans(k), IEEE) * scale_log2
        if softcap_log2 > 0:
            s = softcap(s, softcap_log2)
        s = tl.where(pmask[None, :], s, float("-inf"))
        # online softmax (Milakov & Gimelshein): rescale old state by exp(m_old - m_new)
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        v = load_kv_tile(v_cache_ptr, bt_row, v_scale_ptr, pos, pmask, kv_head, d, dmask,
                         stride_c_block, stride_c_slot, stride_c_head, block_size, cdt, KV_QUANT)
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + mm(p.to(cdt), v, IEEE)
        m = m_new

    if USE_SPLIT:
        # partials: acc (B, Hq, S, D) fp32, ml (B, Hq, S, 2) fp32 = (m, l); empty splits store m=-inf
        row = (seq * group * tl.num_programs(1) + heads) * num_splits + split
        tl.store(part_acc_ptr + row[:, None] * BLOCK_D + d[None, :], acc, mask=gmask[:, None])
        tl.store(part_ml_ptr + row * 2, m, mask=gmask)
        tl.store(part_ml_ptr + row * 2 + 1, l, mask=gmask)
    else:
        out = acc / l[:, None]
        tl.store(out_ptr + seq * stride_o_seq + heads[:, None] * stride_o_head + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=gmask[:, None] & dmask[None, :])


@triton.jit
def _paged_decode_reduce_kernel(part_acc_ptr, part_ml_ptr, sinks_ptr, out_ptr, stride_o_seq, stride_o_head,
                                head_dim, num_splits,
                                BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SINKS: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    # gpt-oss: the head's sink logit (log2 units) joins the denominator as exp(sink - m_all),
    # with m_all raised to the sink when it is larger so that no term overflows; without sinks
    # sink = -inf adds exactly 0
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head)
    else:
        sink = float("-inf")
    base = (seq * tl.num_programs(1) + head) * num_splits
    # pass 1: m_all = max(sink, max_s m_s), over chunks of BLOCK_S splits (a fixed constexpr, so
    # one compiled kernel serves every context length)
    m_all = tl.zeros((), tl.float32) + sink
    for s0 in range(0, num_splits, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        m_s = tl.load(part_ml_ptr + (base + s) * 2, mask=s < num_splits, other=float("-inf"))
        m_all = tl.maximum(m_all, tl.max(m_s, axis=0))
    # pass 2: out = sum_s w_s acc_s / (sum_s w_s l_s + exp(sink - m_all)), w_s = exp(m_s - m_all),
    # chunks summed in a fixed order
    num = tl.zeros((BLOCK_D,), tl.float32)
    denom = tl.zeros((), tl.float32) + tl.exp2(sink - m_all)
    for s0 in range(0, num_splits, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        smask = s < num_splits
        row = base + s
        m_s = tl.load(part_ml_ptr + row * 2, mask=smask, other=float("-inf"))
        l_s = tl.load(part_ml_ptr + row * 2 + 1, mask=smask, other=0.0)
        w = tl.where(m_s == float("-inf"), 0.0, tl.exp2(m_s - m_all))
        acc = tl.load(part_acc_ptr + row[:, None] * BLOCK_D + d[None, :], mask=smask[:, None], other=0.0)
        denom += tl.sum(w * l_s, axis=0)
        num += tl.sum(acc * w[:, None], axis=0)
    out = num / denom
    tl.store(out_ptr + seq * stride_o_seq + head * stride_o_head + d,
             out.to(out_ptr.dtype.element_ty), mask=d < head_dim)


def check_softcap(softcap: Optional[float]) -> None:
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap: must be > 0 or None, got {softcap}")


def sinks_log2(sinks: Optional[torch.Tensor], q: torch.Tensor) -> Optional[torch.Tensor]:
    """Checked per-head sink logits (Hq,) as float32 in log2 units (the kernels' exp2 domain)."""
    if sinks is None:
        return None
    check_shape("sinks", sinks, (q.shape[1],))
    check_device(q, sinks=sinks)
    return (sinks.float() * LOG2E).contiguous()


def check_paged_cache(q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale):
    """Shared input checks of the paged attention launchers; returns whether the KV is quantized."""
    check_dtype("q", q, TORCH_FLOATS)
    check_last_contiguous("q", q)
    if q.dim() != 3:
        raise ValueError(f"q: expected (tokens, num_heads, head_dim), got {tuple(q.shape)}")
    hq, d = q.shape[1:]
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache: expected (num_blocks, block_size, kv_heads, head_dim), got {tuple(k_cache.shape)}")
    hkv = k_cache.shape[2]
    check_shape("k_cache", k_cache, (None, None, hkv, d))
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    if v_cache.stride() != k_cache.stride() or v_cache.dtype != k_cache.dtype:
        raise ValueError("v_cache: must have the same dtype and strides as k_cache")
    check_last_contiguous("k_cache", k_cache)
    if hq % hkv:
        raise ValueError(f"q: num_heads {hq} must be a multiple of the cache's kv_heads {hkv}")
    check_dtype("block_tables", block_tables, (torch.int32, torch.int64))
    check_dtype("seq_lens", seq_lens, (torch.int32, torch.int64))
    if block_tables.dim() != 2 or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables: expected row-major (num_seqs, max_blocks), got {tuple(block_tables.shape)}")
    check_shape("seq_lens", seq_lens, (block_tables.shape[0],))
    check_device(q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, seq_lens=seq_lens,
                 k_scale=k_scale, v_scale=v_scale)
    if k_cache.dtype in (torch.int8, torch.float8_e4m3fn):
        if k_scale is None or v_scale is None:
            raise ValueError(f"k_scale/v_scale: required for a {k_cache.dtype} KV cache")
        check_shape("k_scale", k_scale, (hkv,))
        check_shape("v_scale", v_scale, (hkv,))
        check_dtype("k_scale", k_scale, (torch.float32,))
        check_dtype("v_scale", v_scale, (torch.float32,))
        return True
    check_dtype("k_cache", k_cache, TORCH_FLOATS + (torch.int8, torch.float8_e4m3fn))
    return False


# Keys per split-K partition, fixed: a row's partitions are [0, P), [P, 2P), ... whatever the batch
# and the longest context of the step, and the merge always runs (also for one partition), so a
# row's result never depends on the other rows ("Defeating Nondeterminism in LLM Inference",
# Thinking Machines Lab, 2025: a fixed split size, not a fixed split count). The cost: a small
# batch of short contexts fills fewer SMs than splits sized per step would (docs/determinism.md).
DECODE_PARTITION = 256
# Partials merged per step of the reduce kernel's loop: fixed, like the partition, so that the
# compile-time constants of both kernels never depend on the context length.
REDUCE_CHUNK = 16


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                 sliding_window: Optional[int] = None, k_scale: Optional[torch.Tensor] = None,
                 v_scale: Optional[torch.Tensor] = None, max_seq_len: Optional[int] = None,
                 partition_size: Optional[int] = None, out: Optional[torch.Tensor] = None,
                 softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention of one query per sequence, q (B, Hq, D), over its cached context of seq_lens[b] keys.
    softcap: scores s -> softcap * tanh(s / softcap) before the softmax (None: none).
    sinks: (Hq,) per-head logits in every softmax's denominator (gpt-oss; None: none), added
    where the partitions merge.

    Caches (num_blocks, block_size, Hkv, D); block_tables (B, max_blocks); returns/fills (B, Hq, D).
    partition_size: keys per split-K partition (power of two >= 16); default DECODE_PARTITION
    for every context length, so one compiled kernel serves them all. max_seq_len (host int) avoids a device sync.
    """
    kv_quant = check_paged_cache(q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale)
    b, hq, d = q.shape
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window: must be > 0 or None, got {sliding_window}")
    check_softcap(softcap)
    sinks = sinks_log2(sinks, q)
    if out is None:
        out = torch.empty_like(q)
    check_shape("out", out, (b, hq, d))
    check_last_contiguous("out", out)
    if b == 0:
        return out
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max().item())
    partition = DECODE_PARTITION if partition_size is None else int(partition_size)
    if partition < 16 or partition & (partition - 1):
        raise ValueError(f"partition_size: must be a power of two >= 16, got {partition_size}")
    num_splits = triton.cdiv(max(max_seq_len, 1), partition)
    block_n = min(64, partition)
    block_d = next_pow2(d)
    block_g = max(16, next_pow2(group))  # tl.dot wants M >= 16
    use_split = True  # the merge even for one partition: the same arithmetic for every row
    upcast = dot_upcast(q.dtype)
    if use_split:
        part_acc = torch.empty((b, hq, num_splits, block_d), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((b, hq, num_splits, 2), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out
    # q/out: (B, Hq, D); k_cache/v_cache: (num_blocks, block_size, Hkv, D); block_tables: (B, max_blocks).
    # Grid: (sequence, kv head, partition); program = all `group` query heads of one kv head.
    _paged_decode_kernel[(b, hkv, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens,
        k_scale if kv_quant else q, v_scale if kv_quant else q, out, part_acc, part_ml,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        float(scale) * LOG2E, block_size, d, group, int(sliding_window or 0), num_splits,
        float(softcap or 0.0) * LOG2E, PARTITION=partition, BLOCK_N=block_n, BLOCK_G=block_g, BLOCK_D=block_d,
        KV_QUANT=kv_quant, USE_SPLIT=use_split, UPCAST=upcast, IEEE=upcast or q.dtype == torch.float32,
        num_warps=4)
    if use_split:
        # partials (B, Hq, S, D_pad) -> out (B, Hq, D). Grid: (sequence, query head).
        _paged_decode_reduce_kernel[(b, hq)](
            part_acc, part_ml, part_ml if sinks is None else sinks, out, out.stride(0), out.stride(1), d, num_splits,
            BLOCK_S=REDUCE_CHUNK, BLOCK_D=block_d, HAS_SINKS=sinks is not None, num_warps=4)
    return out
