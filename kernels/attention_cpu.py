"""Attention over a paged KV cache on CPU: the production path (attention_ref.py is its oracle).

Same contract as attention_ref.paged_attention_ref. Two routes:
- native (bfloat16 q and cache, kernels/cpu_decode_attention.c): *every* query row, of a prefill
  chunk, a decode or a speculative verification alike, is one row of the native kernel over its
  own keys [lo, position], in chunks of 64 keys counted from lo. A row's result therefore depends
  on its query and its keys only: not on the batch, on where the prefill chunk boundaries fall,
  or on whether its keys were computed in this step or came from the prefix cache (batch
  invariance; "Defeating Nondeterminism in LLM Inference", Thinking Machines Lab, 2025: a fixed
  split size, not a fixed split count).
- torch (other dtypes, quantized KV caches, TRITIUM_NATIVE_CPU=0): SDPA calls over groups of
  rows, described below; fast, but the groups depend on the batch, so a row's last bits may too.

Per-step state (the row lists, the SDPA groups and their masks, the gather buffers) lives in a
CpuAttentionPlan built once per step and passed in (ModelRunner sets AttentionMetadata.cpu_plan);
layers of one step share it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from . import cpu_native
from .attention_ref import paged_attention_ref
from .kv_write_ref import dequantize_kv_ref


# The torch route, fewer and larger ops than the reference:
# - decode rows (query_len 1) are sorted by context length and run in groups of DECODE_GROUP with
#   one padded SDPA call per group (keys past a row's length masked), K/V gathered block-wise
#   with index_select (several times faster than advanced indexing on CPU);
# - a prefill row is one SDPA call: is_causal for a whole prompt, else an explicit mask (chunk
#   after cached context, sliding window) while the mask has at most SDPA_MASK_MAX elements;
# - beyond that (very long contexts), scores come from fp32 bmm per KV head (the query heads of
#   a GQA group stacked), tiled over PREFILL_TILE queries, each tile seeing only the keys it may
#   attend to, which bounds the score buffer.
DECODE_GROUP = 32  # most decode rows per SDPA call
# What one more decode group costs, in gathered-and-attended key tokens: a group's calls (two
# gathers, SDPA, the q/out indexing) cost about as much as this many padded tokens (on SmolLM2
# shapes, 2 threads: ~80 us per group vs ~0.1 us per token of K+V). Groups are chosen to
# minimise groups * overhead + sum(rows * padded length); fixed groups of 16 padded 28% on the
# bench workload.
DECODE_GROUP_OVERHEAD_TOKENS = 1024
PREFILL_TILE = 128
SDPA_MASK_MAX = 1 << 24  # 16 MB of bool mask


def _gather_blocks(cache: torch.Tensor, tables: torch.Tensor, num_blocks: int, scale, dtype,
                   workspace: Optional[dict] = None, key: str = "",
                   flat: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(n, num_blocks * block_size, Hkv, D) for n block tables, dequantized to `dtype`.

    With a `workspace` dict, the gathered bytes go into a buffer kept there under `key` and reused
    by the next call (the caller must be done with the previous result): writing into memory
    that is already mapped is 2-3x faster on CPU than into a fresh multi-MB allocation.
    `flat` may pass tables[:, :num_blocks] flattened to int64 when the caller already has it."""
    n = tables.shape[0]
    if flat is None:
        flat = tables[:, :num_blocks].reshape(-1).long()
    row_bytes = cache[0].numel() * cache.element_size()
    if cache.is_contiguous() and row_bytes % 8 == 0:
        # Whole blocks as int64 rows: index_select then runs at memcpy speed (5x faster on CPU
        # than selecting 4-d bf16 rows); the bytes are reinterpreted back, not converted.
        src = cache.view(cache.shape[0], -1).view(torch.int64)
        out = None
        if workspace is not None:
            buf = workspace.get(key)
            need = flat.numel() * src.shape[1]
            if buf is None or buf.numel() < need:
                buf = workspace[key] = torch.empty(need, dtype=torch.int64, device=cache.device)
            out = buf[:need].view(flat.numel(), src.shape[1])
        raw = torch.index_select(src, 0, flat, out=out)
        x = raw.view(cache.dtype).view(n, num_blocks * cache.shape[1], *cache.shape[2:])
    else:
        x = torch.index_select(cache, 0, flat).view(n, num_blocks * cache.shape[1], *cache.shape[2:])
    return dequantize_kv_ref(x, scale, dtype) if (scale is not None or x.dtype != dtype) else x


def partition_sorted(lengths: List[int], overhead: float, max_group: int) -> List[Tuple[int, int]]:
    """Split rows, sorted by padded length, into contiguous groups [a, b) of at most max_group
    rows minimising sum over groups of (overhead + rows * the group's longest length), by
    dynamic programming over the split points (O(n * max_group))."""
    n = len(lengths)
    best = [0.0] + [float("inf")] * n
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        top = lengths[j - 1]  # sorted: the last row of a group is its longest
        for i in range(max(0, j - max_group), j):
            c = best[i] + overhead + (j - i) * top
            if c < best[j]:
                best[j], cut[j] = c, i
    groups, j = [], n
    while j > 0:
        groups.append((cut[j], j))
        j = cut[j]
    return groups[::-1]


def _decode_groups(meta, plan: "CpuAttentionPlan", rows, seq_lens, bs: int, window):
    """Groups of decode rows by context length, with their gather indices and masks. The same for
    every layer of a step, so it is built once and kept in the step's plan."""
    # keyed by window: layers of one step may differ in sliding window (per-layer windows)
    plans = plan.sdpa_groups
    if window in plans:
        return plans[window]
    order = sorted(range(len(rows)), key=lambda i: seq_lens[i])
    padded = [-(-seq_lens[i] // bs) * bs for i in order]
    plan = []
    for g0, g1 in partition_sorted(padded, DECODE_GROUP_OVERHEAD_TOKENS, DECODE_GROUP):
        idx = order[g0:g1]
        lens = torch.tensor([seq_lens[i] for i in idx])
        nblk = -(-int(lens.max()) // bs)
        tables = meta.block_tables[[rows[i][0] for i in idx]]
        kpos = torch.arange(nblk * bs)[None, :]
        allowed = kpos < lens[:, None]
        if window is not None:
            allowed &= kpos >= (lens[:, None] - window)
        tok = torch.tensor([rows[i][1] for i in idx])
        flat = tables[:, :nblk].reshape(-1).long()
        plan.append((tok, tables, nblk, {"bool": allowed[:, None, None, :]}, flat))
    plans[window] = plan
    return plan


def _sink_softmax(s: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """softmax over the keys of float32 scores s (..., Hkv, grp, rows, keys) with each query head's
    sink logit (Hq = Hkv * grp, head h = j * grp + g) as one more key, dropped after it (gpt-oss)."""
    hkv, grp = s.shape[-4], s.shape[-3]
    sink = sinks.float().view(hkv, grp, 1, 1).expand(*s.shape[:-1], 1)
    return torch.cat([s, sink], dim=-1).softmax(dim=-1)[..., :-1]


def _decode_rows(q, out, rows, seq_lens, k_cache, v_cache, meta, plan, scale, window, k_scale, v_scale,
                 sinks=None):
    # One workspace per step (in the step's plan): every layer and group of the step reuses its
    # two gather buffers; engines in other threads have their own.
    ws = plan.workspace
    for tok, tables, nblk, masks, flat in _decode_groups(meta, plan, rows, seq_lens, k_cache.shape[1], window):
        # SDPA turns a bool mask into an additive one on every call; build it once per step.
        mask = masks.get(q.dtype)
        if mask is None:
            allowed = masks["bool"]
            mask = torch.zeros(allowed.shape, dtype=q.dtype, device=allowed.device)
            mask = masks[q.dtype] = mask.masked_fill_(~allowed, float("-inf"))
        k = _gather_blocks(k_cache, tables, nblk, k_scale, q.dtype, ws, "k", flat).transpose(1, 2)  # (n, Hkv, L, D)
        v = _gather_blocks(v_cache, tables, nblk, v_scale, q.dtype, ws, "v", flat).transpose(1, 2)
        # The query heads sharing a KV head are that head's query rows (HF repeat_kv order:
        # head h uses KV head h // grp), so K/V are read once for all of them; the mask
        # broadcasts over the rows.
        hkv = k.shape[1]
        qb = q[tok].view(-1, hkv, q.shape[1] // hkv, q.shape[2])  # (n, Hkv, grp, D)
        if sinks is None:
            ob = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=scale)
        else:  # SDPA has no sinks: the same maths written out, float32 scores
            s = torch.matmul(qb.float(), k.float().transpose(-1, -2)).mul_(scale) + mask.float()
            ob = torch.matmul(_sink_softmax(s.unsqueeze(-2), sinks).squeeze(-2), v.float()).to(q.dtype)
        out[tok] = ob.reshape(-1, q.shape[1], q.shape[2])


def _prefill_one(q, out, start, qlen, slen, table, k_cache, v_cache, scale, window, k_scale, v_scale, sinks=None):
    bs = k_cache.shape[1]
    hq, d = q.shape[1], q.shape[2]
    whole = qlen == slen and (window is None or window >= slen)
    if sinks is None and (whole or qlen * slen <= SDPA_MASK_MAX):
        # One SDPA call: for a whole prompt (no earlier context, no window cut) with is_causal and
        # no mask, else with an explicit (qlen, slen) mask. SDPA's CPU flash kernel is 3-7x faster
        # than the tiles below (measured, bf16, one thread: 512-token prompt 2.2 vs 13.2 ms;
        # 256-token chunk after 256 of context 1.3 vs 9.6 ms).
        k = _gather_blocks(k_cache, table[None], -(-slen // bs), k_scale, q.dtype)[:, :slen]
        v = _gather_blocks(v_cache, table[None], -(-slen // bs), v_scale, q.dtype)[:, :slen]
        mask = None
        if not whole:
            qpos = torch.arange(slen - qlen, slen)[:, None]
            kpos = torch.arange(slen)[None, :]
            mask = kpos <= qpos
            if window is not None:
                mask &= (qpos - kpos) < window
        qb = q[start:start + qlen].unsqueeze(0).transpose(1, 2)  # (1, Hq, qlen, D)
        o = F.scaled_dot_product_attention(qb, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                           is_causal=whole, scale=scale, enable_gqa=k.shape[2] != hq)
        out[start:start + qlen] = o[0].transpose(0, 1)
        return
    k = _gather_blocks(k_cache, table[None], -(-slen // bs), k_scale, torch.float32)[0, :slen]
    v = _gather_blocks(v_cache, table[None], -(-slen // bs), v_scale, torch.float32)[0, :slen]
    hkv = k.shape[1]
    grp = hq // hkv
    kt = k.permute(1, 2, 0)  # (Hkv, D, slen)
    vt = v.transpose(0, 1)   # (Hkv, slen, D)
    for t0 in range(0, qlen, PREFILL_TILE):
        t1 = min(qlen, t0 + PREFILL_TILE)
        n = t1 - t0
        # Causal: this tile sees keys [lo, hi) only (hi = its last position + 1; lo from the window).
        hi = slen - qlen + t1
        lo = max(0, slen - qlen + t0 - window + 1) if window is not None else 0
        # q heads h = j * grp + g use KV head j (HF repeat_kv order): stack the group's rows.
        qt = q[start + t0:start + t1].float().view(n, hkv, grp, d).permute(1, 2, 0, 3).reshape(hkv, grp * n, d)
        s = torch.bmm(qt, kt[:, :, lo:hi]).mul_(scale).view(hkv, grp, n, hi - lo)
        qpos = torch.arange(slen - qlen + t0, hi)[:, None]
        kpos = torch.arange(lo, hi)[None, :]
        allowed = kpos <= qpos
        if window is not None:
            allowed &= (qpos - kpos) < window
        s.masked_fill_(~allowed, float("-inf"))
        p = (s.softmax(dim=-1) if sinks is None else _sink_softmax(s, sinks)).view(hkv, grp * n, hi - lo)
        o = torch.bmm(p, vt[:, lo:hi]).view(hkv, grp, n, d).permute(2, 0, 1, 3).reshape(n, hq, d)
        out[start + t0:start + t1] = o.to(out.dtype)


# torch route: queries of at most this many tokens run as decode rows (1 + the largest
# speculative proposal), so a verification shares the decode numerics.
SHORT_QUERY_MAX = 17


@dataclass
class CpuAttentionPlan:
    """One step's CPU attention state, shared by its layers (built by plan_attention)."""
    block_tables: torch.Tensor  # (B, max_blocks) int32, contiguous: what the native kernel reads
    # native route: window -> (n, 4) int64 rows [token row, block-table row, first key, context length]
    native_rows: Dict[Optional[int], torch.Tensor] = field(default_factory=dict)
    # torch route: window -> SDPA groups of decode rows (tokens, tables, blocks, masks, flat ids)
    sdpa_groups: Dict[Optional[int], list] = field(default_factory=dict)
    workspace: Dict[str, torch.Tensor] = field(default_factory=dict)  # gather buffers, reused by layers

    def rows_for(self, meta, window: Optional[int]) -> torch.Tensor:
        """Every query token of the step as a native row, for one sliding window (or None)."""
        if window not in self.native_rows:
            rows = []
            start = 0
            for b, (qlen, slen) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
                for j in range(qlen):
                    n = slen - qlen + 1 + j  # causal: keys [0, position]
                    rows.append((start + j, b, max(0, n - window) if window is not None else 0, n))
                start += qlen
            self.native_rows[window] = torch.tensor(rows, dtype=torch.int64).reshape(-1, 4)
        return self.native_rows[window]


def plan_attention(meta) -> CpuAttentionPlan:
    """An empty plan for one step's metadata (filled lazily by the first layer that needs it)."""
    return CpuAttentionPlan(block_tables=meta.block_tables.contiguous())


def native_route(q: torch.Tensor, k_cache: torch.Tensor, k_scale, meta) -> bool:
    """Whether this layer's attention takes the native, batch-invariant route."""
    return (cpu_native.decode_supported(q, k_cache, k_scale) and meta.block_tables.dtype == torch.int32
            and cpu_native.available())


def paged_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta,
                        scale: float, sliding_window: Optional[int] = None,
                        k_scale: Optional[torch.Tensor] = None,
                        v_scale: Optional[torch.Tensor] = None,
                        plan: Optional[CpuAttentionPlan] = None,
                        softcap: Optional[float] = None,
                        sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """paged_attention_ref's contract on CPU (see the module docstring). (T, Hq, D).
    plan: the step's CpuAttentionPlan (default meta.cpu_plan, else a fresh one for this call).
    softcap: scores -> softcap * tanh(scores / softcap) (Gemma 2): the native route applies it;
    SDPA has none, so off the native route a soft-capped layer runs attention_ref's loop.
    sinks (Hq,): gpt-oss's per-head sink logits. Neither SDPA nor the native kernel has them, so a
    layer with sinks takes the torch route with the softmax written out (float32 scores, the sink
    joins the softmax): decode rows in their groups, prefill rows in the tiles below."""
    if sinks is not None and softcap is not None:  # no family has both; the reference does
        return paged_attention_ref(q, k_cache, v_cache, meta, scale, sliding_window, k_scale, v_scale, softcap,
                                   sinks)
    plan = plan or getattr(meta, "cpu_plan", None) or plan_attention(meta)
    out = torch.empty_like(q)
    if sinks is None and native_route(q, k_cache, k_scale, meta):
        # bfloat16 cache: the native kernel reads K/V in place (kernels/cpu_decode_attention.c)
        cpu_native.paged_decode_bf16(q, k_cache, v_cache, plan.block_tables, plan.rows_for(meta, sliding_window),
                                     scale, out, softcap)
        return out
    if softcap is not None:
        return paged_attention_ref(q, k_cache, v_cache, meta, scale, sliding_window, k_scale, v_scale, softcap)
    decode_rows, decode_lens = [], []
    start = 0
    for b, (qlen, slen) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        if 1 <= qlen <= SHORT_QUERY_MAX:
            # token j is a decode row over the first slen - qlen + 1 + j keys (causal)
            for j in range(qlen):
                decode_rows.append((b, start + j))
                decode_lens.append(slen - qlen + 1 + j)
        elif qlen > 1:
            _prefill_one(q, out, start, qlen, slen, meta.block_tables[b], k_cache, v_cache, scale,
                         sliding_window, k_scale, v_scale, sinks)
        start += qlen
    if decode_rows:
        _decode_rows(q, out, decode_rows, decode_lens, k_cache, v_cache, meta, plan, scale,
                     sliding_window, k_scale, v_scale, sinks)
    return out
