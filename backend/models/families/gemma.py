"""Gemma 2 and Gemma 3 (text): sandwich norms (before and after attention and the MLP) with
(1 + w) weights, embeddings times sqrt(hidden_size), GELU-tanh, query_pre_attn_scalar as the
softmax scale, alternating sliding / global layers; Gemma 2 soft-caps attention scores and
logits; Gemma 3 adds per-head q/k norms and its own RoPE base for the sliding layers."""
from .base import SANDWICH_NORMS, Family, activation, positive


def _gemma_fields(cfg: dict) -> dict:
    return {"activation": activation(cfg, "hidden_activation", "gelu_pytorch_tanh"),
            "norm_placement": "sandwich",
            "attention_scale": float(cfg.get("query_pre_attn_scalar") or 256) ** -0.5,
            "attn_logit_softcap": positive(cfg, "attn_logit_softcapping"),
            "final_logit_softcap": positive(cfg, "final_logit_softcapping"),
            "embedding_multiplier": float(cfg["hidden_size"]) ** 0.5}


def _gemma3_fields(cfg: dict) -> dict:
    return {**_gemma_fields(cfg), "qk_norm": "head"}


GEMMA2 = Family("gemma2", ("gemma2",), hf_fields=_gemma_fields, norms=dict(SANDWICH_NORMS),
                norm_plus_one=True, default_sliding=lambda cfg, i: i % 2 == 0)
# Gemma 3's local RoPE (rope_parameters.sliding_attention / rope_local_base_freq) is read by the
# shared rope reader (builder/hf_loader.py), as every per-layer-type rope is.
GEMMA3 = Family("gemma3", ("gemma3_text",), hf_fields=_gemma3_fields, norms=dict(SANDWICH_NORMS),
                norm_plus_one=True,
                default_sliding=lambda cfg, i: (i + 1) % int(cfg.get("sliding_window_pattern") or 6) != 0)
