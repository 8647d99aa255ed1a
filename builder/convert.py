"""Map Hugging Face Llama-family tensor names onto Tritium engine tensors (fusing qkv, gate_up).

Each engine tensor's shape is checked against the ModelConfig, so a checkpoint whose dims
disagree with its config fails with the tensor name and both shapes.
"""
from __future__ import annotations

from typing import Callable, Iterator, Tuple

import torch

from tritium.backend.config import ModelConfig


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

    `get(name)` returns the float tensor for an HF name (raising CheckpointError if absent).
    """
    h, d = m.hidden_size, m.head_dim
    qd, kvd = m.num_heads * d, m.num_kv_heads * d

    def g(name, shape):
        return _expect(name, get(name), shape, source).to(dtype)

    yield "embed_tokens.weight", g("model.embed_tokens.weight", (m.vocab_size, h))
    for i in range(m.num_layers):
        p = f"model.layers.{i}."
        yield f"layers.{i}.input_norm.weight", g(p + "input_layernorm.weight", (h,))
        yield f"layers.{i}.post_attn_norm.weight", g(p + "post_attention_layernorm.weight", (h,))
        q = g(p + "self_attn.q_proj.weight", (qd, h))
        k = g(p + "self_attn.k_proj.weight", (kvd, h))
        v = g(p + "self_attn.v_proj.weight", (kvd, h))
        yield f"layers.{i}.qkv_proj.weight", torch.cat([q, k, v], 0)
        if m.attention_bias:
            yield f"layers.{i}.qkv_proj.bias", torch.cat([
                g(p + "self_attn.q_proj.bias", (qd,)), g(p + "self_attn.k_proj.bias", (kvd,)),
                g(p + "self_attn.v_proj.bias", (kvd,))], 0)
        yield f"layers.{i}.o_proj.weight", g(p + "self_attn.o_proj.weight", (h, qd))
        gate = g(p + "mlp.gate_proj.weight", (m.intermediate_size, h))
        up = g(p + "mlp.up_proj.weight", (m.intermediate_size, h))
        yield f"layers.{i}.gate_up_proj.weight", torch.cat([gate, up], 0)
        yield f"layers.{i}.down_proj.weight", g(p + "mlp.down_proj.weight", (h, m.intermediate_size))
    yield "norm.weight", g("model.norm.weight", (h,))
    if not m.tie_word_embeddings:
        if not has("lm_head.weight"):
            raise CheckpointError(f"{source}: tensor 'lm_head.weight' missing and tie_word_embeddings is false")
        yield "lm_head.weight", g("lm_head.weight", (m.vocab_size, h))
