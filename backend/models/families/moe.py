"""Mixture-of-experts families: a dense family's attention with a routed MLP (backend/models/moe.py).

    Mixtral    Mistral's layer; block_sparse_moe.{gate, experts.{e}.w1/w3/w2}; top-k renormalized
    Qwen3-MoE  Qwen3's layer (per-head q/k norms); mlp.{gate, experts.{e}.*}; norm_topk_prob;
               dense MLPs on mlp_only_layers and off the decoder_sparse_step grid
    Qwen2-MoE  Qwen2's layer (q/k/v bias); as Qwen3-MoE plus a shared expert behind a sigmoid gate
    OLMoE      OLMo-style q/k norms over the whole projections, pre-norms; mlp.{gate, experts}
Router settings this engine does not implement stop the build with the field named.
"""
from __future__ import annotations

from .base import Family, FamilyConfigError, llama_fields

SCORING = ("softmax",)
TOPK_METHODS = ("greedy",)


def _int(cfg: dict, *keys: str, default=None) -> int:
    for key in keys:
        if cfg.get(key) is not None:
            v = cfg[key]
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise FamilyConfigError(f"{key} {v!r} must be a positive integer")
            return v
    if default is None:
        raise FamilyConfigError(f"{keys[0]} is required for model_type {cfg.get('model_type')!r}")
    return default


def moe_fields(cfg: dict, inter_key: str, normalize) -> dict:
    """The ModelConfig MoE fields from config.json; `normalize` None = read norm_topk_prob."""
    scoring = cfg.get("scoring_func", "softmax")
    if scoring not in SCORING:
        raise FamilyConfigError(f"scoring_func {scoring!r} is not supported; supported: {', '.join(SCORING)}")
    method = cfg.get("topk_method", "greedy")
    if method not in TOPK_METHODS:
        raise FamilyConfigError(f"topk_method {method!r} is not supported; supported: {', '.join(TOPK_METHODS)}")
    experts = _int(cfg, "num_experts", "num_local_experts")
    top_k = _int(cfg, "num_experts_per_tok")
    if top_k > experts:
        raise FamilyConfigError(f"num_experts_per_tok {top_k} exceeds the number of experts {experts}")
    layers = _int(cfg, "num_hidden_layers")
    step = _int(cfg, "decoder_sparse_step", default=1)
    only = cfg.get("mlp_only_layers") or []
    if not isinstance(only, list) or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < layers
                                         for i in only):
        raise FamilyConfigError(f"mlp_only_layers {only!r} must list layer indices in [0, {layers})")
    dense = tuple(i for i in range(layers) if i in only or (i + 1) % step != 0)
    if len(dense) == layers:
        raise FamilyConfigError(f"mlp_only_layers {only!r} / decoder_sparse_step {step} leave no sparse layer")
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    return {"num_experts": experts, "num_experts_per_tok": top_k,
            "moe_intermediate_size": _int(cfg, inter_key, "intermediate_size"),
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)) if normalize is None else normalize,
            "router_scoring": scoring, "dense_layers": dense, "shared_expert_intermediate_size": shared,
            "shared_expert_gate": shared > 0}


def _olmoe_fields(cfg: dict) -> dict:
    if cfg.get("clip_qkv") is not None:
        raise FamilyConfigError(f"clip_qkv {cfg['clip_qkv']!r} is not supported; supported: null")
    return {**llama_fields(cfg), "qk_norm": "full", **moe_fields(cfg, "intermediate_size", None)}


MIXTRAL = Family("mixtral", ("mixtral",), o_proj_bias=False, moe_block="block_sparse_moe",
                 expert_names=("w1", "w3", "w2"),
                 hf_fields=lambda cfg: {**llama_fields(cfg), **moe_fields(cfg, "intermediate_size", True)})
QWEN3_MOE = Family("qwen3_moe", ("qwen3_moe",),
                   hf_fields=lambda cfg: {**llama_fields(cfg), "qk_norm": "head",
                                          **moe_fields(cfg, "moe_intermediate_size", None)})
QWEN2_MOE = Family("qwen2_moe", ("qwen2_moe",), default_attention_bias=True, o_proj_bias=False,
                   hf_fields=lambda cfg: {**llama_fields(cfg), **moe_fields(cfg, "moe_intermediate_size", None)})
OLMOE = Family("olmoe", ("olmoe",), hf_fields=_olmoe_fields)
