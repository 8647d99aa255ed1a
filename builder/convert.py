"""Map Hugging Face tensor names (every family of backend/models/families/) onto Tritium engine tensors (fusing qkv, gate_up).

Each engine tensor's shape is checked against the ModelConfig, so a checkpoint whose dims
disagree with its config fails with the tensor name and both shapes.
"""
from __future__ import annotations

from typing import Callable, Iterator, Tuple

import torch

from tritium.backend.config import ModelConfig
from tritium.backend.models.families import FAMILIES

from .convert_mla import mla_layer_tensors
from .convert_moe import moe_layer_tensors


class CheckpointError(ValueError):
    """A checkpoint that cannot be turned into an engine; the message names file/tensor/field."""


def _expect(name: str, t: torch.Tensor, shape: tuple, source: str) -> torch.Tensor:
    if tuple(t.shape) != tuple(shape):
        raise CheckpointError(f"{source}: tensor {name!r} has shape {tuple(t.shape)} but the config "
                              f"implies {tuple(shape)}")
    return t


def hf_to_engine_tensors(m: ModelConfig, get: Callable[[str], torch.Tensor], has: Callable[[str], bool],
                         dtype: torch.dtype, source: str) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield (engine_name, tensor) pairs, one layer at a time, reading HF names through `get`.

    `get(name)` returns the float tensor for an HF name (raising CheckpointError if absent). The
    family (backend/models/families/) says which norms a layer has and what HF calls them, whether
    the checkpoint fuses qkv_proj / gate_up_proj (Phi-3), and whether norm weights are stored as
    offsets from one (Gemma: HF computes x * (1 + w); the engine stores 1 + w, added in float32).
    """
    fam = FAMILIES[m.architecture]
    h, d, inter = m.hidden_size, m.head_dim, m.intermediate_size
    qd, kvd = m.num_heads * d, m.num_kv_heads * d

    def g(name, shape):
        return _expect(name, get(name), shape, source).to(dtype)

    def norm(name, shape):
        t = _expect(name, get(name), shape, source)
        return (t.float() + 1.0).to(dtype) if fam.norm_plus_one else t.to(dtype)

    yield "embed_tokens.weight", g("model.embed_tokens.weight", (m.vocab_size, h))
    qk_shapes = {"head": ((d,), (d,)), "full": ((qd,), (kvd,))}.get(m.qk_norm)
    for i in range(m.num_layers):
        p = f"model.layers.{i}."
        for engine_norm, hf_norm in fam.norms.items():
            yield f"layers.{i}.{engine_norm}.weight", norm(p + hf_norm + ".weight", (h,))
        if qk_shapes is not None:
            yield f"layers.{i}.q_norm.weight", norm(p + "self_attn.q_norm.weight", qk_shapes[0])
            yield f"layers.{i}.k_norm.weight", norm(p + "self_attn.k_norm.weight", qk_shapes[1])
        if m.kv_lora_rank:  # multi-head latent attention (DeepSeek)
            yield from mla_layer_tensors(m, fam, i, g)
        elif fam.fused_qkv:
            yield f"layers.{i}.qkv_proj.weight", g(p + "self_attn.qkv_proj.weight", (qd + 2 * kvd, h))
        else:
            yield f"layers.{i}.qkv_proj.weight", torch.cat([
                g(p + "self_attn.q_proj.weight", (qd, h)), g(p + "self_attn.k_proj.weight", (kvd, h)),
                g(p + "self_attn.v_proj.weight", (kvd, h))], 0)
        if m.attention_bias:
            yield f"layers.{i}.qkv_proj.bias", (g(p + "self_attn.qkv_proj.bias", (qd + 2 * kvd,)) if fam.fused_qkv
                                                else torch.cat([g(p + "self_attn.q_proj.bias", (qd,)),
                                                                g(p + "self_attn.k_proj.bias", (kvd,)),
                                                                g(p + "self_attn.v_proj.bias", (kvd,))], 0))
        if not m.kv_lora_rank:
            yield f"layers.{i}.o_proj.weight", g(p + "self_attn.o_proj.weight", (h, qd))
        if m.o_proj_bias:
            yield f"layers.{i}.o_proj.bias", g(p + "self_attn.o_proj.bias", (h,))
        if m.attention_sinks:  # gpt-oss: sinks, router and experts (convert_gpt_oss.py)
            from .convert_gpt_oss import gpt_oss_layer_tensors
            yield from gpt_oss_layer_tensors(m, i, g, lambda n, shape: _expect(n, get(n), shape, source), has)
        elif m.sparse(i):
            for name, t in moe_layer_tensors(m, fam, i, g):
                if name.endswith(".router.weight") and fam.float32_router:  # as stored, then float32
                    t = _expect(p + f"{fam.moe_block}.gate.weight", get(p + f"{fam.moe_block}.gate.weight"),
                                (m.num_experts, h), source).float()
                yield name, t
            if m.router_correction_bias:  # kept float32: it decides which experts run
                name = p + f"{fam.moe_block}.gate.e_score_correction_bias"
                yield f"layers.{i}.router.correction_bias", _expect(name, get(name), (m.num_experts,), source).float()
        elif fam.fused_gate_up:  # Phi-3 stores [gate; up] rows, the engine's order
            yield f"layers.{i}.gate_up_proj.weight", g(p + "mlp.gate_up_proj.weight", (2 * inter, h))
        else:
            yield f"layers.{i}.gate_up_proj.weight", torch.cat([
                g(p + "mlp.gate_proj.weight", (inter, h)), g(p + "mlp.up_proj.weight", (inter, h))], 0)
        if m.mlp_bias and not m.sparse(i):
            yield f"layers.{i}.gate_up_proj.bias", torch.cat([
                g(p + "mlp.gate_proj.bias", (inter,)), g(p + "mlp.up_proj.bias", (inter,))], 0)
        if not m.sparse(i):
            yield f"layers.{i}.down_proj.weight", g(p + "mlp.down_proj.weight", (h, inter))
        if m.mlp_bias and not m.sparse(i):
            yield f"layers.{i}.down_proj.bias", g(p + "mlp.down_proj.bias", (h,))
    yield "norm.weight", norm("model.norm.weight", (h,))
    if not m.tie_word_embeddings:
        if not has("lm_head.weight"):
            raise CheckpointError(f"{source}: tensor 'lm_head.weight' missing and tie_word_embeddings is false")
        yield "lm_head.weight", g("lm_head.weight", (m.vocab_size, h))
