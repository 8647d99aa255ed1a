"""gpt-oss (OpenAI, 2025): a mixture of experts with attention sinks.

Llama-style pre-norm layers; q/k/v/o projections with biases; a learned sink logit per query head
that joins every softmax's denominator (self_attn.sinks); sliding-window and full-attention layers
alternating (layer_types, sliding_window; transformers' default slides on even layers); YaRN RoPE.
Every MLP is sparse: a router with a bias takes the top-k logits and a softmax over those k;
experts carry biases and apply the clamped SwiGLU (swiglu_limit, swiglu_alpha). The checkpoint
stacks the experts (mlp.experts.gate_up_proj (E, hidden, 2I) with gate / up columns interleaved,
down_proj (E, I, hidden)), in float or as MXFP4 `*_blocks` / `*_scales` (builder/convert_gpt_oss.py).
"""
from __future__ import annotations

import math

from .base import Family, FamilyConfigError
from .moe import moe_fields


def _gpt_oss_fields(cfg: dict) -> dict:
    act = cfg.get("hidden_act") or "silu"
    if act != "silu":  # the experts' SwiGLU is the only MLP; transformers ignores any other name
        raise FamilyConfigError(f"hidden_act {act!r} is not supported for gpt_oss; supported: silu")
    if cfg.get("mlp_only_layers") or (cfg.get("decoder_sparse_step") or 1) != 1:
        raise FamilyConfigError("mlp_only_layers / decoder_sparse_step: gpt_oss has no dense MLP layers; "
                                "supported: none / 1")
    out = {}
    for key, default in (("swiglu_limit", 7.0), ("swiglu_alpha", 1.702)):
        v = cfg.get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise FamilyConfigError(f"{key} {v!r} must be a positive number")
        out[key] = float(v)
    return {**moe_fields(cfg, "intermediate_size", False), "activation": "silu", "attention_sinks": True,
            "router_bias": True, "router_topk_then_softmax": True, "expert_bias": True, **out}


GPT_OSS = Family("gpt_oss", ("gpt_oss",), hf_fields=_gpt_oss_fields, default_attention_bias=True,
                 default_sliding=lambda cfg, i: (i + 1) % 2 != 0)
