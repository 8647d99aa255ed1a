"""Multi-head latent attention (MLA) of DeepSeek-V2 / V3 over a paged latent cache.

From the DeepSeek-V2 paper ("DeepSeek-V2: A Strong, Economical, and Efficient Mixture-of-Experts
Language Model", 2024). Per token:
    q       = q_proj(x), or q_b_proj(rms(q_a_proj(x)))                (H, nope + rope)
    [c, kr] = kv_a_proj(x);  c = rms(c)                               c (rank), kr (rope): shared by all heads
    k_h     = [W_UK_h c | rope(kr)],  v_h = W_UV_h c                  (kv_b_proj = [W_UK; W_UV] per head)
The paged cache holds [c | rope(kr)] per token per layer (rank + rope values), never per-head K
and V. Decode rows use the absorbed form:
    score = (W_UK_h^T q_nope) . c + q_pe . rope(kr),   out_h = W_UV_h (sum_j p_j c_j)
so a step reads the latent rows once for all heads (kernels/mla_ref.py, mla_triton.py). The rows
of a sequence with many new tokens (a prompt) expand its context instead, where that costs fewer
multiply-adds (mla_prefill.py).
RoPE rotates the rope parts only; the builder reorders DeepSeek's interleaved pairs to the
half-split layout of ops.rotary (families/base.py rope_interleaved). The softmax scale (with
YaRN's mscale correction) is ModelConfig.attention_scale.
Engine tensors of layer i: q_proj.weight | q_a_proj.weight, q_a_norm.weight, q_b_proj.weight;
kv_a_proj.weight (rank + rope, hidden), kv_a_norm.weight (rank,), kv_b_proj.weight
(H (nope + v), rank), o_proj.weight (hidden, H v). Under tensor parallelism a rank holds whole
heads of q, kv_b_proj and o_proj, and replicas of the rest (builder/convert_mla.py).
"""
from __future__ import annotations

import torch
from torch import nn

from tritium.kernels import ops

from .linear import make_linear
from .mla_prefill import expand_min_rows, expanded_attention, row_split

NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: transformers builds them with the default eps


class Weight(nn.Module):
    """A module holding one float `weight` buffer that the CPU packing leaves alone (the norms, and
    kv_b_proj, whose per-head blocks the absorbed form multiplies directly)."""

    def __init__(self, *shape: int, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("weight", torch.empty(*shape, dtype=dtype))


class LatentAttention:
    """Mixin with PagedAttention's two methods (`_init_attention`, `attention`), first in a layer's bases."""

    def _init_attention(self, cfg, idx: int, dtype: torch.dtype) -> None:
        m, q = cfg.model, cfg.quantization.layers
        h = m.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = m.num_heads, m.num_kv_heads, m.head_dim
        self.nope, self.rope_dim, self.v_dim, self.rank = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, \
            m.kv_lora_rank
        self.scale = m.attention_scale if m.attention_scale is not None else m.head_dim ** -0.5
        self.rope_kind, self.window, self.softcap, self.qk_norm = "global", None, None, "none"
        self.k_scale = self.v_scale = self.k_offset = self.v_offset = None
        self.kv_rotation = False
        self.expand_min_rows = expand_min_rows(self.rank, self.nope, self.v_dim)
        qd = m.num_heads * m.head_dim
        if m.q_lora_rank:
            self.q_a_proj = make_linear(h, m.q_lora_rank, False, dtype, q.get(f"layers.{idx}.q_a_proj"))
            self.q_a_norm = Weight(m.q_lora_rank, dtype=dtype)
            self.q_b_proj = make_linear(m.q_lora_rank, qd, False, dtype, q.get(f"layers.{idx}.q_b_proj"))
        else:
            self.q_proj = make_linear(h, qd, False, dtype, q.get(f"layers.{idx}.q_proj"))
        self.kv_a_proj = make_linear(h, self.rank + self.rope_dim, False, dtype, q.get(f"layers.{idx}.kv_a_proj"))
        self.kv_a_norm = Weight(self.rank, dtype=dtype)
        self.kv_b_proj = Weight(m.num_heads * (self.nope + self.v_dim), self.rank, dtype=dtype)
        self.o_proj = make_linear(m.num_heads * self.v_dim, h, False, dtype, q.get(f"layers.{idx}.o_proj"))

    @property
    def plain_kv(self) -> bool:
        return True

    def query(self, x: torch.Tensor) -> torch.Tensor:
        """(T, hidden) -> (T, H, nope + rope)."""
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(ops.rms_norm(self.q_a_proj(x), self.q_a_norm.weight, NORM_EPS)[0])
        return q.view(x.shape[0], self.num_heads, self.head_dim)

    def latent(self, x: torch.Tensor, positions, rope):
        """The cache rows [c | rope(k_pe)] (T, rank + rope) and the rotated q_pe (T, H, rope) follow
        from `x`; returns (q_nope, q_pe, rows)."""
        t = x.shape[0]
        q = self.query(x)
        ckv = self.kv_a_proj(x)
        c = ops.rms_norm(ckv[:, :self.rank].contiguous(), self.kv_a_norm.weight, NORM_EPS)[0]
        q_pe, k_pe = ops.rotary(q[..., self.nope:].contiguous(), ckv[:, self.rank:].reshape(t, 1, self.rope_dim).contiguous(),
                                positions, rope.caches["global"], rope.tables.get("global"))
        return q[..., :self.nope], q_pe, torch.cat([c, k_pe.reshape(t, self.rope_dim).to(c.dtype)], dim=-1)

    def attention(self, positions, x, kv_cache, meta, rope) -> torch.Tensor:
        """x (T, hidden) -> o_proj output (T, hidden), this rank's partial sum under TP."""
        t = x.shape[0]
        latent_cache = kv_cache[0]
        q_nope, q_pe, rows = self.latent(x, positions, rope)
        latent_cache.view(-1, self.rank + self.rope_dim).index_copy_(0, meta.slot_mapping, rows)
        split = row_split(meta, self.expand_min_rows, latent_cache.shape[1])
        if not split.expanded:
            out = self.absorbed(q_nope, q_pe, latent_cache, meta)
        else:  # prompt rows expand their context (mla_prefill.py); the others stay absorbed
            out = q_nope.new_empty(t, self.num_heads, self.v_dim)
            if split.absorbed_meta is not None:
                r = split.absorbed_rows
                out[r] = self.absorbed(q_nope[r], q_pe[r], latent_cache, split.absorbed_meta)
            q = torch.cat([q_nope, q_pe.to(q_nope.dtype)], dim=-1)
            for start, ql, sl, b in split.expanded:
                out[start:start + ql] = expanded_attention(q[start:start + ql], latent_cache, self.kv_b_proj.weight,
                                                           meta, b, ql, sl, self.rank, self.nope, self.scale)
        return self.o_proj(out.reshape(t, self.num_heads * self.v_dim))

    def absorbed(self, q_nope, q_pe, latent_cache, meta) -> torch.Tensor:
        """The absorbed form: (T, H, nope), (T, H, rope) -> (T, H, v); no per-head K or V formed."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.rank)
        q_lat = torch.bmm(q_nope.transpose(0, 1), w[:, :self.nope])  # (H, T, rank): W_UK absorbed
        q_abs = torch.cat([q_lat.transpose(0, 1), q_pe.to(q_lat.dtype)], dim=-1)  # (T, H, rank + rope)
        out_lat = ops.mla_attention(q_abs, latent_cache, meta, self.scale, self.rank)  # (T, H, rank)
        return torch.bmm(out_lat.transpose(0, 1), w[:, self.nope:].transpose(1, 2)).transpose(0, 1)  # W_UV
