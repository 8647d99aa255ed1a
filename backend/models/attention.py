"""The attention block over the paged KV cache, shared by every family.

A mixin of DecoderLayer rather than a sub-module, so the layer keeps the flat engine tensor names
(`layers.{i}.qkv_proj.*`, `layers.{i}.q_norm.weight`) that quantization, tensor parallelism and
the weight files use. What the families change is read from ModelConfig: the softmax scale
(Gemma's query_pre_attn_scalar, Granite's attention_multiplier), score soft-capping (Gemma 2),
the sliding window of this layer, gpt-oss's per-head attention sinks, q/k RMSNorms per head
(Qwen3, Gemma 3) or over the whole projection (OLMo 2), which rotary table the layer uses (global,
Gemma 3's local one, or none for SmolLM3's NoPE layers) and partial rotary dimensions (Phi-3 /
Phi-4 partial_rotary_factor).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from tritium.kernels import ops

from .kv_rotation import rotate
from .linear import make_linear

KVCache = Tuple[torch.Tensor, torch.Tensor]  # (k_cache, v_cache), each (num_blocks, block_size, Hkv, D)


class PagedAttention:
    """Mixin: `_init_attention` registers the tensors, `attention` runs the block."""

    def _init_attention(self, cfg, idx: int, dtype: torch.dtype) -> None:
        m = cfg.model
        q = cfg.quantization.layers
        self.num_heads, self.num_kv_heads, self.head_dim = m.num_heads, m.num_kv_heads, m.head_dim
        self.window = m.window(idx)
        self.scale = m.attention_scale if m.attention_scale is not None else m.head_dim ** -0.5
        self.softcap = m.attn_logit_softcap
        self.rope_kind = m.rope_kind(idx)  # "global" | "local" | None (NoPE)
        self.rotary_dim = m.rotary_dim or m.head_dim
        self.qk_norm = m.qk_norm
        qkv_out = (m.num_heads + 2 * m.num_kv_heads) * m.head_dim
        self.qkv_proj = make_linear(m.hidden_size, qkv_out, m.attention_bias, dtype,
                                    q.get(f"layers.{idx}.qkv_proj"))
        self.o_proj = make_linear(m.num_heads * m.head_dim, m.hidden_size, m.o_proj_bias, dtype,
                                  q.get(f"layers.{idx}.o_proj"))
        qn, kn = {"head": (m.head_dim, m.head_dim), "full": (m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim),
                  "none": (None, None)}[m.qk_norm]
        self.register_buffer("q_norm_weight", None if qn is None else torch.empty(qn, dtype=dtype))
        self.register_buffer("k_norm_weight", None if kn is None else torch.empty(kn, dtype=dtype))
        # gpt-oss: one learned logit per query head in the softmax denominator (layers.{i}.sinks)
        self.register_buffer("sinks", torch.empty(m.num_heads, dtype=dtype) if m.attention_sinks else None)
        # Per-KV-head scales of a quantized KV cache; None for a float cache.
        self.k_scale: Optional[torch.Tensor] = None
        self.v_scale: Optional[torch.Tensor] = None
        # Quantized KV: a per-KV-head vector (Hkv, D) subtracted from K (after RoPE) before it is
        # stored. q.(k - c) = q.k - q.c shifts all of one query's scores by the same amount, which
        # softmax ignores, so attention is unchanged while the stored K loses its constant part.
        self.k_offset: Optional[torch.Tensor] = None
        # Likewise v_offset (Hkv, D) is subtracted from V before it is stored and added back to
        # the attention output: sum_j p_j (v_j - c) + c = sum_j p_j v_j, as the p_j sum to 1.
        self.v_offset: Optional[torch.Tensor] = None
        # K and V stored in Hadamard-rotated coordinates, the query rotated alike (kv_rotation.py).
        self.kv_rotation = cfg.kv_cache.rotation == "hadamard"

    @property
    def plain_kv(self) -> bool:
        """K and V stored as computed: no offsets, no rotation, no quantization scales."""
        return self.k_offset is None and self.v_offset is None and not self.kv_rotation and self.k_scale is None

    def attention(self, positions, x, kv_cache: KVCache, meta, rope) -> torch.Tensor:
        """x (T, hidden) -> o_proj output (T, hidden), this rank's partial sum under TP."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        k_cache, v_cache = kv_cache
        tables = rope.tables.get(self.rope_kind) if self.rope_kind is not None else None
        if (self.plain_kv and self.qk_norm == "none" and self.rope_kind is not None
                and self.rotary_dim == self.head_dim
                and ops.can_fuse_rotary_kv_write(qkv, self.head_dim, k_cache, tables)):
            q = ops.rotary_kv_write(qkv, self.num_heads, self.num_kv_heads, self.head_dim, tables, k_cache,
                                    v_cache, meta.slot_mapping)
        else:
            q = self._qk_kv_write(qkv, t, positions, rope, k_cache, v_cache, meta)
        attn = ops.paged_attention(q, k_cache, v_cache, meta, self.scale, self.window, self.k_scale,
                                   self.v_scale, softcap=self.softcap, sinks=self.sinks)
        if self.kv_rotation:
            attn = rotate(attn)  # H @ H = I: back to V's own coordinates
        if self.v_offset is not None:
            # query head h reads KV head h // (num_heads / num_kv_heads) (HF repeat_kv order)
            rep = self.num_heads // self.num_kv_heads
            attn = attn + self.v_offset.to(attn.dtype).repeat_interleave(rep, dim=0)
        return self.o_proj(attn.reshape(t, self.num_heads * self.head_dim))

    def split_qkv(self, qkv: torch.Tensor):
        """(T, (Hq + 2 Hkv) D) -> q (T, Hq, D), k, v (T, Hkv, D) as views."""
        t = qkv.shape[0]
        nq, nkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return (qkv[:, :nq].view(t, self.num_heads, self.head_dim),
                qkv[:, nq:nq + nkv].view(t, self.num_kv_heads, self.head_dim),
                qkv[:, nq + nkv:].view(t, self.num_kv_heads, self.head_dim))

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor):
        """The family's q/k RMSNorm on q (T, Hq, D) and k (T, Hkv, D); identity without one."""
        if self.qk_norm == "none":
            return q, k
        t, d = q.shape[0], self.head_dim
        if self.qk_norm == "head":
            qn, _ = ops.rms_norm(q.reshape(-1, d), self.q_norm_weight, self.eps)
            kn, _ = ops.rms_norm(k.reshape(-1, d), self.k_norm_weight, self.eps)
            return qn.view(t, -1, d), kn.view(t, -1, d)
        return self._full_norm_qk(q.reshape(t, -1), k.reshape(t, -1))

    def _full_norm_qk(self, q: torch.Tensor, k: torch.Tensor):
        """OLMo 2: RMSNorm over the whole q (T, Hq D) and k (T, Hkv D) projections. Under tensor
        parallelism a rank holds some heads, so the sums of squares and the element counts are
        summed over the ranks (a KV head replicated on r ranks counts r times in both, which
        leaves the mean unchanged)."""
        qf, kf = q.float(), k.float()
        stats = torch.stack([qf.pow(2).sum(-1), torch.full_like(qf[:, 0], qf.shape[1]),
                             kf.pow(2).sum(-1), torch.full_like(kf[:, 0], kf.shape[1])], dim=1)
        if self.tp is not None:
            self.tp.all_reduce(stats)
        qn = qf * torch.rsqrt(stats[:, :1] / stats[:, 1:2] + self.eps)
        kn = kf * torch.rsqrt(stats[:, 2:3] / stats[:, 3:4] + self.eps)
        t, d = q.shape[0], self.head_dim
        return ((self.q_norm_weight.float() * qn).to(q.dtype).view(t, -1, d),
                (self.k_norm_weight.float() * kn).to(k.dtype).view(t, -1, d))

    def rotate_qk(self, q: torch.Tensor, k: torch.Tensor, positions, rope):
        """RoPE with this layer's table on the first rotary_dim channels of each head."""
        if self.rope_kind is None:
            return q, k
        cache, tables = rope.caches[self.rope_kind], rope.tables.get(self.rope_kind)
        rd = self.rotary_dim
        if rd == self.head_dim:
            return ops.rotary(q, k, positions, cache, tables)
        qr, kr = ops.rotary(q[..., :rd].contiguous(), k[..., :rd].contiguous(), positions, cache, tables)
        return torch.cat([qr, q[..., rd:]], dim=-1), torch.cat([kr, k[..., rd:]], dim=-1)

    def _qk_kv_write(self, qkv, t, positions, rope, k_cache, v_cache, meta):
        """q/k norm, RoPE, the quantized cache's offsets and rotation, and the cache write; returns q."""
        q, k, v = self.split_qkv(qkv)
        q, k = self.rotate_qk(*self.norm_qk(q, k), positions, rope)
        k_store = k if self.k_offset is None else k - self.k_offset.to(k.dtype)
        v_store = v if self.v_offset is None else v - self.v_offset.to(v.dtype)
        if self.kv_rotation:
            q, k_store, v_store = rotate(q), rotate(k_store), rotate(v_store)
        ops.kv_write(k_store, v_store, k_cache, v_cache, meta.slot_mapping, self.k_scale, self.v_scale)
        return q
