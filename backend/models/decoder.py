"""Llama-family decoder (Llama incl. Llama-3 RoPE scaling, Mistral sliding window, Qwen2 qkv bias).

Plain torch and device-agnostic; every op goes through tritium.kernels.ops so that the Triton
kernels drop in on GPU. Forward runs over a flat batch of new tokens with a paged KV cache.
Weight names (engine safetensors):
    embed_tokens.weight, norm.weight, lm_head.weight (absent when tied)
    layers.{i}.input_norm.weight, layers.{i}.post_attn_norm.weight
    layers.{i}.qkv_proj.*  ([q; k; v] rows), layers.{i}.o_proj.*
    layers.{i}.gate_up_proj.*  ([gate; up] rows), layers.{i}.down_proj.*
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import nn

from tritium.kernels import ops
from tritium.kernels.rotary import rope_cos_sin_cache, rope_inv_freq

from tritium.kernels.attention_metadata import AttentionMetadata
from ..config import EngineConfig
from .kv_rotation import rotate
from .linear import DenseLinear, cpu_packing_supported, make_linear, pack_for_cpu, packed_linear

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

KVCache = Tuple[torch.Tensor, torch.Tensor]  # (k_cache, v_cache), each (num_blocks, block_size, Hkv, D)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: EngineConfig, idx: int):
        super().__init__()
        m = cfg.model
        dtype = TORCH_DTYPES[cfg.dtype]
        q = cfg.quantization.layers
        self.idx = idx
        self.num_heads, self.num_kv_heads, self.head_dim = m.num_heads, m.num_kv_heads, m.head_dim
        self.eps = m.rms_norm_eps
        self.window = m.window(idx)
        self.scale = m.head_dim ** -0.5
        qkv_out = (m.num_heads + 2 * m.num_kv_heads) * m.head_dim
        self.register_buffer("input_norm_weight", torch.empty(m.hidden_size, dtype=dtype))
        self.register_buffer("post_attn_norm_weight", torch.empty(m.hidden_size, dtype=dtype))
        self.qkv_proj = make_linear(m.hidden_size, qkv_out, m.attention_bias, dtype,
                                    q.get(f"layers.{idx}.qkv_proj"))
        self.o_proj = make_linear(m.num_heads * m.head_dim, m.hidden_size, False, dtype,
                                  q.get(f"layers.{idx}.o_proj"))
        self.gate_up_proj = make_linear(m.hidden_size, 2 * m.intermediate_size, False, dtype,
                                        q.get(f"layers.{idx}.gate_up_proj"))
        self.down_proj = make_linear(m.intermediate_size, m.hidden_size, False, dtype,
                                     q.get(f"layers.{idx}.down_proj"))
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
        # Tensor parallelism (backend/parallel/comm.py): o_proj and down_proj hold this rank's
        # input features; their partial outputs are summed over the ranks. None on one rank.
        self.tp = None

    def forward(self, positions, hidden, residual, kv_cache: KVCache, meta: AttentionMetadata,
                cos_sin_cache, rope=None):
        x, residual = ops.rms_norm(hidden, self.input_norm_weight, self.eps, residual)
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        nq = self.num_heads * self.head_dim
        k_cache, v_cache = kv_cache
        if self.plain_kv and ops.can_fuse_rotary_kv_write(qkv, self.head_dim, k_cache, rope):
            q = ops.rotary_kv_write(qkv, self.num_heads, self.num_kv_heads, self.head_dim, rope, k_cache,
                                    v_cache, meta.slot_mapping)
        else:
            q = self._rotary_kv_write(qkv, t, positions, cos_sin_cache, rope, k_cache, v_cache, meta)
        attn = ops.paged_attention(q, k_cache, v_cache, meta, self.scale, self.window,
                                   self.k_scale, self.v_scale)
        if self.kv_rotation:
            attn = rotate(attn)  # H @ H = I: back to V's own coordinates
        if self.v_offset is not None:
            # query head h reads KV head h // (num_heads / num_kv_heads) (HF repeat_kv order)
            rep = self.num_heads // self.num_kv_heads
            attn = attn + self.v_offset.to(attn.dtype).repeat_interleave(rep, dim=0)
        hidden = self.o_proj(attn.reshape(t, nq))
        if self.tp is not None:
            self.tp.all_reduce(hidden)
        x, residual = ops.rms_norm(hidden, self.post_attn_norm_weight, self.eps, residual)
        hidden = self.down_proj(ops.silu_mul(self.gate_up_proj(x)))
        if self.tp is not None:
            self.tp.all_reduce(hidden)
        return hidden, residual

    @property
    def plain_kv(self) -> bool:
        """K and V stored as computed: no offsets, no rotation, no quantization scales."""
        return self.k_offset is None and self.v_offset is None and not self.kv_rotation and self.k_scale is None

    def _rotary_kv_write(self, qkv, t, positions, cos_sin_cache, rope, k_cache, v_cache, meta):
        """RoPE, the quantized cache's offsets and rotation, and the cache write; returns q."""
        nq, nkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q = qkv[:, :nq].view(t, self.num_heads, self.head_dim)
        k = qkv[:, nq:nq + nkv].view(t, self.num_kv_heads, self.head_dim)
        v = qkv[:, nq + nkv:].view(t, self.num_kv_heads, self.head_dim)
        q, k = ops.rotary(q, k, positions, cos_sin_cache, rope)
        k_store = k if self.k_offset is None else k - self.k_offset.to(k.dtype)
        v_store = v if self.v_offset is None else v - self.v_offset.to(v.dtype)
        if self.kv_rotation:
            q, k_store, v_store = rotate(q), rotate(k_store), rotate(v_store)
        ops.kv_write(k_store, v_store, k_cache, v_cache, meta.slot_mapping, self.k_scale, self.v_scale)
        return q


class DecoderLM(nn.Module):
    """The whole decoder-only LM. Build with from_config, then load_engine_weights."""

    def __init__(self, cfg: EngineConfig):
        super().__init__()
        m = cfg.model
        self.cfg = cfg
        self.dtype = TORCH_DTYPES[cfg.dtype]
        # int4 builds store the embedding as per-row int8 (LayerQuant "int8" under "embed_tokens"):
        # an Int8Linear (vocab, hidden) whose rows are gathered for the lookup and which, when
        # tied, is also the logits GEMM. Otherwise a float buffer.
        eq = cfg.quantization.layers.get("embed_tokens")
        self.embed_tokens = None
        if eq is not None and eq.method != "none":
            if eq.method != "int8":
                raise ValueError(f"quantization.layers.embed_tokens.method {eq.method!r} not supported; "
                                 f"allowed: none, int8")
            self.embed_tokens = make_linear(m.hidden_size, m.vocab_size, False, self.dtype, eq)
        self.register_buffer("embed_tokens_weight", None if self.embed_tokens is not None else
                             torch.empty(m.vocab_size, m.hidden_size, dtype=self.dtype))
        # AWQ-scaled tied head: the lookup divides the int8 rows by these (LayerQuant.input_scale).
        self.register_buffer("embed_input_scale", torch.empty(m.hidden_size, dtype=torch.float32)
                             if eq is not None and eq.input_scale else None)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(m.num_layers))
        self.register_buffer("norm_weight", torch.empty(m.hidden_size, dtype=self.dtype))
        self.packed_head: Optional[torch.Tensor] = None  # set by pack_for_cpu (tied head, CPU bf16)
        self.lm_head = None if m.tie_word_embeddings else make_linear(
            m.hidden_size, m.vocab_size, False, self.dtype, cfg.quantization.layers.get("lm_head"))
        # A centred head (LayerQuant.centred): logits = (h - head_input_mean) W^T + head_mean_logits.
        hq = cfg.quantization.layers.get("embed_tokens" if m.tie_word_embeddings else "lm_head")
        centred = hq is not None and hq.centred
        self.register_buffer("head_input_mean", torch.empty(m.hidden_size, dtype=torch.float32)
                             if centred else None)
        self.register_buffer("head_mean_logits", torch.empty(m.vocab_size, dtype=torch.float32)
                             if centred else None)
        r = m.rope
        inv_freq = rope_inv_freq(m.head_dim, r.theta, r.scaling_type, r.factor, r.low_freq_factor,
                                 r.high_freq_factor, r.original_max_position_embeddings)
        max_pos = max(cfg.limits.max_seq_len, 1)
        self.register_buffer("cos_sin_cache", rope_cos_sin_cache(inv_freq, max_pos), persistent=False)
        self.tp = None  # see set_tensor_parallel

    def set_tensor_parallel(self, tp) -> None:
        """Run as one rank of a tensor-parallel group (backend/parallel/comm.TPGroup): this model
        holds the rank's shard (built from parallel_layout.local_config), the embedding and LM head
        hold the vocabulary rows [tp.vocab_start, tp.vocab_end)."""
        self.tp = tp
        for layer in self.layers:
            layer.tp = tp

    # Engine tensor name <-> module attribute. Norm/embedding buffers use '_weight' attributes
    # so the engine names stay the familiar dotted ones.
    @staticmethod
    def engine_name_to_attr(name: str) -> str:
        for suffix in ("input_norm.weight", "post_attn_norm.weight"):
            if name.endswith(suffix):
                return name[: -len(suffix)] + suffix.replace(".weight", "_weight")
        if name in ("embed_tokens.weight", "norm.weight"):
            return name.replace(".weight", "_weight")
        if name == "embed_tokens.input_scale":
            return "embed_input_scale"
        return name

    def load_engine_weights(self, tensors: dict) -> None:
        """Assign engine tensors (name -> tensor); errors name the tensor that is wrong."""
        own = dict(self.named_buffers())
        own.pop("cos_sin_cache", None)
        seen = set()
        for name, t in tensors.items():
            attr = self.engine_name_to_attr(name)
            if attr.endswith(("k_scale", "v_scale", "k_offset", "v_offset")):
                layer = self.layers[int(attr.split(".")[1])]
                setattr(layer, attr.split(".")[-1], t.float())
                continue
            if attr not in own:
                raise ValueError(f"engine weights: unexpected tensor {name!r}")
            cur = own[attr]
            if cur is not None and tuple(cur.shape) != tuple(t.shape):
                raise ValueError(f"engine weights: tensor {name!r} has shape {tuple(t.shape)}, "
                                 f"config implies {tuple(cur.shape)}")
            mod_name, _, leaf = attr.rpartition(".")
            mod = self.get_submodule(mod_name) if mod_name else self
            target_dtype = cur.dtype if cur is not None else t.dtype
            mod._buffers[leaf] = t.to(target_dtype)
            seen.add(attr)
        missing = [n for n, b in own.items() if b is not None and n not in seen]
        if missing:
            raise ValueError(f"engine weights: missing tensors {missing[:5]}"
                             f"{' ...' if len(missing) > 5 else ''}")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: List[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: (T,). Returns final hidden states (T, hidden)."""
        hidden = self.embed(input_ids)
        residual = None
        rope = ops.rotary_prepare(positions, self.cos_sin_cache, self.dtype)  # once per step
        for layer, kv in zip(self.layers, kv_caches):
            hidden, residual = layer(positions, hidden, residual, kv, meta, self.cos_sin_cache, rope)
        hidden, _ = ops.rms_norm(hidden, self.norm_weight, self.cfg.model.rms_norm_eps, residual)
        return hidden

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(T,) token ids -> (T, hidden); an int8 embedding dequantizes only the gathered rows."""
        if self.tp is None:
            return self._embed_rows(input_ids)
        # Vocab-parallel: look up the ids this rank holds, zero the others, sum over the ranks.
        local = input_ids - self.tp.vocab_start
        mine = (local >= 0) & (local < self.tp.vocab_end - self.tp.vocab_start)
        rows = self._embed_rows(torch.where(mine, local, torch.zeros_like(local)))
        rows = rows * mine.unsqueeze(1).to(rows.dtype)
        self.tp.all_reduce(rows)
        return rows

    def _embed_rows(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is None:
            return self.embed_tokens_weight[input_ids]
        e = self.embed_tokens
        rows = e.qweight[input_ids].float() * e.scales[input_ids, None].float()
        if self.embed_input_scale is not None:
            rows = rows / self.embed_input_scale
        return rows.to(self.dtype)

    def pack_for_cpu(self) -> int:
        """Inference on CPU: pre-pack every float linear for oneDNN (see linear.pack_for_cpu),
        and the tied bf16 LM head as a packed copy (the lookup still gathers rows of the plain
        embedding, so that copy is the one extra vocab x hidden matrix this costs). Idempotent;
        returns how many weights are packed."""
        n = sum(bool(mod.pack_for_cpu()) for mod in self.modules() if isinstance(mod, DenseLinear))
        if self.lm_head is None and self.embed_tokens is None and self.packed_head is None \
                and cpu_packing_supported(self.embed_tokens_weight):
            self.packed_head = pack_for_cpu(self.embed_tokens_weight)
        return n + (self.packed_head is not None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> float32 logits (N, vocab); under tensor parallelism, on rank 0 only."""
        if self.head_input_mean is not None:  # centred head: subtract in float32, then the GEMM
            hidden = (hidden.float() - self.head_input_mean).to(hidden.dtype)
        if self.lm_head is None and self.embed_tokens is not None:
            logits = self.embed_tokens(hidden)  # packed int8 GEMM (CPU) / linear_w8a16 (CUDA)
        elif self.lm_head is None and self.packed_head is not None:
            logits = packed_linear(hidden, self.packed_head, None)
        elif self.lm_head is None:
            logits = torch.nn.functional.linear(hidden, self.embed_tokens_weight)
        else:
            logits = self.lm_head(hidden)
        logits = logits.float()
        logits = logits if self.head_mean_logits is None else logits + self.head_mean_logits
        # Vocab-parallel head: rank 0 gathers every rank's columns (None on the other ranks).
        return logits if self.tp is None else self.tp.gather_logits(logits)
