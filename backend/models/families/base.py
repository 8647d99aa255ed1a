"""The Family declaration and the config.json readers that several families share."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple

# Engine norm name -> HF name inside model.layers.{i}. The engine names say what a norm feeds:
# input_norm -> attention, post_attn_norm -> MLP (the historical name: Llama's
# post_attention_layernorm), attn_out_norm / mlp_out_norm -> the block outputs before the residual add.
PRE_NORMS = {"input_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm"}
SANDWICH_NORMS = {"input_norm": "input_layernorm", "attn_out_norm": "post_attention_layernorm",
                  "post_attn_norm": "pre_feedforward_layernorm", "mlp_out_norm": "post_feedforward_layernorm"}
POST_NORMS = {"attn_out_norm": "post_attention_layernorm", "mlp_out_norm": "post_feedforward_layernorm"}

# HF activation names -> ModelConfig.activation
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
               "gelu": "gelu"}


class FamilyConfigError(ValueError):
    """A config.json value this engine cannot honour; the message names the field and the value."""


@dataclass(frozen=True)
class Family:
    name: str  # ModelConfig.architecture
    hf_model_types: Tuple[str, ...]
    # config.json dict -> ModelConfig fields beyond the shared ones (activation, norms, caps, ...)
    hf_fields: Callable[[dict], dict] = lambda cfg: {}
    norms: Dict[str, str] = field(default_factory=lambda: dict(PRE_NORMS))
    norm_plus_one: bool = False  # HF computes x * (1 + w): the engine stores 1 + w (Gemma)
    fused_qkv: bool = False  # the checkpoint holds self_attn.qkv_proj (Phi-3)
    fused_gate_up: bool = False  # the checkpoint holds mlp.gate_up_proj (Phi-3)
    default_attention_bias: bool = False  # q/k/v bias when config.json does not say (Qwen2)
    o_proj_bias: bool = True  # o_proj carries a bias when attention_bias is set (not Qwen2 / Mistral)
    # The layer_types transformers derives when config.json has none: (config, i) -> sliding?
    default_sliding: Optional[Callable[[dict, int], bool]] = None
    # Mixture of experts (families/moe.py): the HF module holding router and experts in a layer,
    # and what an expert calls its gate, up and down projections.
    moe_block: str = "mlp"
    expert_names: Tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    shared_expert_name: str = "shared_expert"  # DeepSeek: shared_experts
    # Multi-head latent attention (DeepSeek): the rope part of q and k is stored in interleaved
    # pairs (x0, x1), (x2, x3), ...; the builder reorders those rows to [even | odd] so that the
    # engine's half-split RoPE applies (config.json's rope_interleave, when present, decides).
    rope_interleaved: bool = False
    float32_router: bool = False  # the builder stores router.weight float32 (DeepSeek; moe_routing.py)


def activation(cfg: dict, key: str = "hidden_act", default: str = "silu") -> str:
    """ModelConfig.activation of the HF activation named by cfg[key]; refuses the others."""
    name = cfg.get(key) or default
    if name not in ACTIVATIONS:
        raise FamilyConfigError(f"{key} {name!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def positive(cfg: dict, key: str) -> Optional[float]:
    """An optional positive float (soft-caps); None or absent -> None."""
    v = cfg.get(key)
    if v is None:
        return None
    if not isinstance(v, (int, float)) or v <= 0 or not math.isfinite(v):
        raise FamilyConfigError(f"{key} {v!r} must be a positive number or null")
    return float(v)


def llama_fields(cfg: dict) -> dict:
    """The fields every Llama-like family reads: the MLP activation and bias."""
    return {"activation": activation(cfg), "mlp_bias": bool(cfg.get("mlp_bias", False))}
