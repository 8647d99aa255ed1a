"""The decoder-only LM of every family: embedding, layers (layer.py), final norm, LM head.

Plain torch and device-agnostic; every op goes through tritium.kernels.ops so that the Triton
kernels drop in on GPU. Forward runs over a flat batch of new tokens with a paged KV cache.
The families (families/) differ only in ModelConfig fields: here the embedding multiplier
(Gemma's sqrt(hidden), Granite's), the rotary tables (global, Gemma 3's local one), and the
head's logits_scaling (Granite) and final soft-cap (Gemma 2/3).
Weight names (engine safetensors):
    embed_tokens.weight, norm.weight, lm_head.weight (absent when tied)
    layers.{i}.{input_norm,post_attn_norm,attn_out_norm,mlp_out_norm}.weight (per norm placement)
    layers.{i}.q_norm.weight, layers.{i}.k_norm.weight (q/k norms)
    layers.{i}.qkv_proj.*  ([q; k; v] rows), layers.{i}.o_proj.*
    layers.{i}.gate_up_proj.*  ([gate; up] rows), layers.{i}.down_proj.*
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
from torch import nn

from tritium.kernels import ops

from tritium.kernels.attention_metadata import AttentionMetadata
from tritium.kernels.quant_layouts import unpack_int4
from ..config import EngineConfig
from .attention import KVCache
from .layer import NORM_NAMES, DecoderLayer
from .moe import MLAMoEDecoderLayer, MoEDecoderLayer
from .native_step import NativeStep
from .linear import DenseLinear, cpu_packing_supported, make_linear, pack_for_cpu, packed_linear
from .rope import rope_table

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

__all__ = ["DecoderLM", "DecoderLayer", "KVCache", "RopeState", "TORCH_DTYPES"]


@dataclass
class RopeState:
    """A step's rotary state, shared by the layers: per table kind ("global", "local") the
    (max_pos, rotary_dim) [cos | sin] table and the CPU path's per-step tables (or None)."""
    caches: Dict[str, torch.Tensor]
    tables: Dict[str, object]


class DecoderLM(nn.Module):
    """The whole decoder-only LM. Build with from_config, then load_engine_weights."""

    def __init__(self, cfg: EngineConfig):
        super().__init__()
        m = cfg.model
        self.cfg = cfg
        self.dtype = TORCH_DTYPES[cfg.dtype]
        # Quantized builds store the embedding as int8 (LayerQuant "int8" under "embed_tokens"; per
        # row in int4 builds, symmetric groups of 32 in int8 / fp8 builds): an Int8Linear (vocab,
        # hidden) whose rows are gathered for the lookup and which, when tied, is also the logits
        # GEMM. Otherwise a float buffer.
        eq = cfg.quantization.layers.get("embed_tokens")
        self.embed_tokens = None
        if eq is not None and eq.method != "none":
            if eq.method not in ("int8", "int6", "int4"):
                raise ValueError(f"quantization.layers.embed_tokens.method {eq.method!r} not supported; "
                                 f"allowed: none, int8, int6, int4")
            self.embed_tokens = make_linear(m.hidden_size, m.vocab_size, False, self.dtype, eq)
        self.register_buffer("embed_tokens_weight", None if self.embed_tokens is not None else
                             torch.empty(m.vocab_size, m.hidden_size, dtype=self.dtype))
        # AWQ-scaled tied head: the lookup divides the int8 rows by these (LayerQuant.input_scale).
        self.register_buffer("embed_input_scale", torch.empty(m.hidden_size, dtype=torch.float32)
                             if eq is not None and eq.input_scale else None)
        layer_cls = MLAMoEDecoderLayer if m.kv_lora_rank else MoEDecoderLayer if m.num_experts else DecoderLayer
        self.layers = nn.ModuleList(layer_cls(cfg, i, self.dtype) for i in range(m.num_layers))
        self.register_buffer("norm_weight", torch.empty(m.hidden_size, dtype=self.dtype))
        self.packed_head: Optional[torch.Tensor] = None  # set by pack_for_cpu (tied head, CPU bf16)
        self.lm_head = None if m.tie_word_embeddings else make_linear(
            m.hidden_size, m.vocab_size, False, self.dtype, cfg.quantization.layers.get("lm_head"))
        head = self.lm_head if self.lm_head is not None else self.embed_tokens
        if head is not None:
            head.is_head = True  # its CPU kernel choice: backend/quant.py head_activation_quant
        # A centred head (LayerQuant.centred): logits = (h - head_input_mean) W^T + head_mean_logits.
        hq = cfg.quantization.layers.get("embed_tokens" if m.tie_word_embeddings else "lm_head")
        centred = hq is not None and hq.centred
        self.register_buffer("head_input_mean", torch.empty(m.hidden_size, dtype=torch.float32)
                             if centred else None)
        self.register_buffer("head_mean_logits", torch.empty(m.vocab_size, dtype=torch.float32)
                             if centred else None)
        # Rotary tables: `cos_sin_cache` for the global rope, `cos_sin_cache_local` for Gemma 3's
        # sliding layers; a table is built only if some layer uses it.
        max_pos = max(cfg.limits.max_seq_len, 1)
        dim = m.rotary_dim or m.head_dim
        kinds = {m.rope_kind(i) for i in range(m.num_layers)}
        self.register_buffer("cos_sin_cache", rope_table(m.rope, dim, m.max_position_embeddings, max_pos)
                             if "global" in kinds else None, persistent=False)
        self.register_buffer("cos_sin_cache_local", rope_table(m.rope_local, dim, m.max_position_embeddings, max_pos)
                             if "local" in kinds else None, persistent=False)
        self.tp = None  # see set_tensor_parallel

    def rope_state(self, positions: torch.Tensor) -> RopeState:
        """The step's rotary state for `positions` (T,), computed once and shared by the layers."""
        caches = {k: c for k, c in (("global", self.cos_sin_cache), ("local", self.cos_sin_cache_local))
                  if c is not None}
        return RopeState(caches, {k: ops.rotary_prepare(positions, c, self.dtype) for k, c in caches.items()})

    def rope_cache_of(self, layer) -> Optional[torch.Tensor]:
        """The [cos | sin] table `layer` rotates with (None for a NoPE layer)."""
        return {"global": self.cos_sin_cache, "local": self.cos_sin_cache_local, None: None}[layer.rope_kind]

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
        for norm in NORM_NAMES:
            suffix = f".{norm}.weight"
            if name.startswith("layers.") and name.endswith(suffix):
                return name[: -len(suffix)] + f".{norm}_weight"
        if name in ("embed_tokens.weight", "norm.weight"):
            return name.replace(".weight", "_weight")
        if name == "embed_tokens.input_scale":
            return "embed_input_scale"
        return name

    def load_engine_weights(self, tensors: dict) -> None:
        """Assign engine tensors (name -> tensor); errors name the tensor that is wrong."""
        own = dict(self.named_buffers())
        own.pop("cos_sin_cache", None)
        own.pop("cos_sin_cache_local", None)
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
            mod_name, _, leaf = attr.rpartition(".")
            mod = self.get_submodule(mod_name) if mod_name else self
            if cur is not None and tuple(cur.shape) != tuple(t.shape):
                raise ValueError(f"engine weights: tensor {name!r} has shape {tuple(t.shape)}, "
                                 f"config implies {tuple(cur.shape)}")
            target_dtype = cur.dtype if cur is not None else t.dtype
            if leaf in ("scales", "zeros") and t.dtype in (torch.float16, torch.bfloat16):
                # engine format 3: 16-bit group parameters stay 16-bit in memory; the CPU kernels
                # widen them to float32 when they pack the weight (kernels/cpu_linear.py), the
                # Triton GEMMs read them as stored
                target_dtype = t.dtype
            mod._buffers[leaf] = t.to(target_dtype)
            seen.add(attr)
        missing = [n for n, b in own.items() if b is not None and n not in seen]
        if missing:
            raise ValueError(f"engine weights: missing tensors {missing[:5]}"
                             f"{' ...' if len(missing) > 5 else ''}")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: List[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: (T,). Returns final hidden states (T, hidden)."""
        native = NativeStep.get(self) if input_ids.device.type == "cpu" else None
        if native is not None:  # a decode-sized step: the whole of it in one native call, same bits
            out = native.run_step(self, input_ids, positions, kv_caches, meta)
            if out is not None:
                return out
        hidden = self.embed(input_ids)
        residual = None
        rope = self.rope_state(positions)  # once per step
        native = NativeStep.get(self) if hidden.device.type == "cpu" else None
        if native is not None and native.takes(hidden, kv_caches, meta, rope):
            hidden, residual = native.run(hidden, kv_caches, meta, rope)  # every layer, one call, same bits
        else:
            for layer, kv in zip(self.layers, kv_caches):
                hidden, residual = layer(positions, hidden, residual, kv, meta, rope)
        hidden, _ = ops.rms_norm(hidden, self.norm_weight, self.cfg.model.rms_norm_eps, residual)
        return hidden

    def decode_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: List[KVCache],
                      meta: AttentionMetadata):
        """compute_logits(forward(...)) of every row and each row's argmax (a list), in one native
        call (backend/models/native_step.py), or None where this model or step does not take it."""
        native = NativeStep.get(self) if input_ids.device.type == "cpu" else None
        return None if native is None else native.run_step(self, input_ids, positions, kv_caches, meta, logits=True)

    def can_burst(self) -> bool:
        """Whether decode_burst can run this model (NativeStep.can_burst)."""
        native = NativeStep.get(self) if self.tp is None else None
        return native is not None and native.can_burst(self)

    def decode_burst(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: List[KVCache],
                     meta: AttentionMetadata, k: int, stop_ids: list):
        """Up to k greedy decode steps in one native call (NativeStep.run_burst): each step's
        tokens, or None where this model or step does not take it."""
        native = NativeStep.get(self) if input_ids.device.type == "cpu" else None
        return None if native is None else native.run_burst(self, input_ids, positions, kv_caches, meta, k, stop_ids)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(T,) token ids -> (T, hidden); an int8 embedding dequantizes only the gathered rows."""
        if self.tp is None:
            return self._scale_embedding(self._embed_rows(input_ids))
        # Vocab-parallel: look up the ids this rank holds, zero the others, sum over the ranks.
        local = input_ids - self.tp.vocab_start
        mine = (local >= 0) & (local < self.tp.vocab_end - self.tp.vocab_start)
        rows = self._embed_rows(torch.where(mine, local, torch.zeros_like(local)))
        rows = rows * mine.unsqueeze(1).to(rows.dtype)
        self.tp.all_reduce(rows)
        return self._scale_embedding(rows)

    def _scale_embedding(self, rows: torch.Tensor) -> torch.Tensor:
        """Times ModelConfig.embedding_multiplier, rounded to the dtype first (as Gemma does)."""
        mult = self.cfg.model.embedding_multiplier
        if mult == 1.0:
            return rows
        # The multiplier rounded to the dtype on the host (no device copy in the step, so a CUDA
        # graph can capture it); the product of two dtype values is exact in float32 before it
        # is rounded once, as a tensor-by-tensor product would be.
        return rows * float(torch.tensor(mult, dtype=rows.dtype))

    def _embed_rows(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is None:
            return self.embed_tokens_weight[input_ids]
        e = self.embed_tokens
        if e.method == "int4":  # codes 0..15, two per byte; scales / zeros (hidden / G, vocab)
            q = unpack_int4(e.qweight[input_ids]).float() - 8.0
            g = e.group_size
            s = e.scales[:, input_ids].t().float()[:, :, None]
            rows = q.view(q.shape[0], -1, g) * s
            if e.zeros is not None:  # asymmetric (symmetric int4: no zeros)
                rows = rows + e.zeros[:, input_ids].t().float()[:, :, None]
            rows = rows.view(q.shape)
            return rows.to(self.dtype)
        q = e.codes(input_ids).float()  # int8 / int6: the stored codes of the gathered rows
        if e.group_size:  # scales (hidden / G, vocab): each gathered row's groups
            g = e.group_size
            rows = (q.view(q.shape[0], -1, g) * e.scales[:, input_ids].t().float()[:, :, None]).view(q.shape)
        else:
            rows = q * e.scales[input_ids, None].float()
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
        logits = logits if self.tp is None else self.tp.gather_logits(logits)
        return None if logits is None else self._finish_logits(logits)

    def _finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Granite's logits_scaling, then the final soft-cap cap * tanh(logits / cap) (Gemma 2/3)."""
        m = self.cfg.model
        if m.logits_scaling != 1.0:
            logits = logits / m.logits_scaling
        if m.final_logit_softcap is not None:
            logits = torch.tanh(logits / m.final_logit_softcap) * m.final_logit_softcap
        return logits
