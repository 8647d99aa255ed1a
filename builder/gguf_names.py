"""GGUF tensor names -> Hugging Face tensor names, per architecture, and the edits llama.cpp's
converter made to the values that must be undone on the way back.

Edits (conversion/*.py in llama.cpp's converter):
- LlamaModel and its subclasses (llama, mistral, granite, smollm3) permute the rows of q_proj /
  k_proj (weights and biases) for ggml's interleaved RoPE; undone here.
- Gemma 2 and Gemma 3 store every `*norm.weight` as w + 1 (the (1 + w) of Gemma's RMSNorm);
  w is given back as stored - 1. For |w| <= 1 that subtraction is exact in float32 (Sterbenz),
  so 1 + w is bit-identical to what transformers computes.
- Phi-3's fused qkv_proj and gate_up_proj are stored fused, as in the checkpoint.
"""
from __future__ import annotations

from typing import Dict

import torch

from .gguf_mla import MLA_LAYER_NAMES

# layer tensor suffix in GGUF -> suffix under model.layers.{i}. in HF
_ATTN = {
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias", "attn_output.bias": "self_attn.o_proj.bias",
}
_MLP = {
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight", "ffn_gate.bias": "mlp.gate_proj.bias",
    "ffn_up.bias": "mlp.up_proj.bias", "ffn_down.bias": "mlp.down_proj.bias",
}
_PRE_NORMS = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight"}
_QK_NORMS = {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
_SANDWICH_NORMS = {
    "attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight", "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_LLAMA = {**_PRE_NORMS, **_ATTN, **_MLP}
LAYER_NAMES: Dict[str, Dict[str, str]] = {
    "llama": _LLAMA, "mistral": _LLAMA, "qwen2": _LLAMA, "granite": _LLAMA, "smollm3": _LLAMA,
    "qwen3": {**_LLAMA, **_QK_NORMS},
    "gemma2": {**_SANDWICH_NORMS, **_ATTN, **_MLP},
    "gemma3": {**_SANDWICH_NORMS, **_QK_NORMS, **_ATTN, **_MLP},
    # OLMo 2 normalizes after attention and after the MLP only (no pre-norms).
    "olmo2": {"post_attention_norm.weight": "post_attention_layernorm.weight",
              "post_ffw_norm.weight": "post_feedforward_layernorm.weight", **_QK_NORMS, **_ATTN, **_MLP},
    # mixtures of experts: the attention and norms here, the experts in gguf_moe.py
    "qwen3moe": {**_PRE_NORMS, **_QK_NORMS, **_ATTN},
    "olmoe": {**_PRE_NORMS, **_QK_NORMS, **_ATTN},
    "gpt-oss": {"attn_norm.weight": "input_layernorm.weight",
                "post_attention_norm.weight": "post_attention_layernorm.weight", **_ATTN},
    "deepseek2": MLA_LAYER_NAMES,
    "phi3": {**_PRE_NORMS, "attn_qkv.weight": "self_attn.qkv_proj.weight",
             "attn_output.weight": "self_attn.o_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight",
             "ffn_down.weight": "mlp.down_proj.weight"},
}
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
# Architectures whose converter (LlamaModel.undo_permute) permutes Q/K rows.
PERMUTED_QK = ("llama", "mistral", "granite", "smollm3")
# Architectures whose converter stores RMSNorm weights as w + 1.
NORM_PLUS_ONE = ("gemma2", "gemma3")


def hf_to_gguf_names(arch: str, num_layers: int) -> Dict[str, str]:
    """HF tensor name -> GGUF tensor name, for every tensor the architecture can have."""
    out = {hf: g for g, hf in _GLOBAL.items()}
    for i in range(num_layers):
        for g, hf in LAYER_NAMES[arch].items():
            out[f"model.layers.{i}.{hf}"] = f"blk.{i}.{g}"
    return out


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp's permute: rows (head, 2, d/2) were stored as (head, d/2, 2)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def undo_converter_edits(arch: str, gguf_name: str, w: torch.Tensor, num_heads: int,
                         num_kv_heads: int) -> torch.Tensor:
    """The HF checkpoint's values of GGUF tensor `gguf_name` (float32 `w` as stored)."""
    if arch in PERMUTED_QK:
        if gguf_name.endswith(("attn_q.weight", "attn_q.bias")):
            return unpermute(w, num_heads)
        if gguf_name.endswith(("attn_k.weight", "attn_k.bias")):
            return unpermute(w, num_kv_heads)
    if arch in NORM_PLUS_ONE and gguf_name.endswith("norm.weight"):
        return w - 1.0
    return w
