"""DeepSeek-V2 (and V2-Lite's layout) and DeepSeek-V3: multi-head latent attention
(backend/models/mla.py) with a mixture of experts whose router is DeepSeek's
(backend/models/moe_routing.py), shared experts, and dense MLPs on the first layers.

    V2  softmax scores; topk_method greedy or group_limited_greedy (groups ranked by their best
        expert); weights times routed_scaling_factor, never renormalized (as transformers does).
    V3  sigmoid scores; noaux_tc: groups ranked by the sum of their two best scores plus
        e_score_correction_bias, the bias used to choose experts only; norm_topk_prob then
        routed_scaling_factor.
Both: q_a_proj / q_a_layernorm / q_b_proj when q_lora_rank is set, else q_proj (V2-Lite);
kv_a_proj_with_mqa -> latent + rope key, kv_a_layernorm, kv_b_proj; YaRN's mscale_all_dim
squared on the softmax scale. Layer i is dense when i < first_k_dense_replace or
i % moe_layer_freq != 0 (DeepSeek's own rule; transformers ignores moe_layer_freq, and every
published checkpoint has 1). What the engine cannot honour stops the build naming the field.
"""
from __future__ import annotations

import math

from .base import Family, FamilyConfigError, activation
from .moe import _int

# (model_type, scoring_func, topk_method) combinations this engine runs
ROUTERS = {"deepseek_v2": {("softmax", "greedy"), ("softmax", "group_limited_greedy")},
           "deepseek_v3": {("sigmoid", "noaux_tc")}}


def _mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _softmax_scale(cfg: dict, qk_head_dim: int) -> float:
    """qk_head_dim ** -0.5, times mscale(factor, mscale_all_dim) ** 2 under a scaled rope (YaRN)."""
    scale = qk_head_dim ** -0.5
    rp = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    if (rp.get("rope_type") or rp.get("type") or "default") != "default" and rp.get("mscale_all_dim"):
        factor = rp.get("factor") or cfg["max_position_embeddings"] / rp["original_max_position_embeddings"]
        scale *= _mscale(float(factor), float(rp["mscale_all_dim"])) ** 2
    return scale


def _router_fields(cfg: dict, v3: bool) -> dict:
    arch = cfg.get("model_type")
    scoring = cfg.get("scoring_func") or ("sigmoid" if v3 else "softmax")
    method = cfg.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    if (scoring, method) not in ROUTERS[arch]:
        field, value = ("scoring_func", scoring) if scoring not in {s for s, _ in ROUTERS[arch]} \
            else ("topk_method", method)
        allowed = sorted({(s if field == "scoring_func" else t) for s, t in ROUTERS[arch]})
        raise FamilyConfigError(f"{field} {value!r} is not supported for {arch}; supported: {', '.join(allowed)}")
    experts = _int(cfg, "n_routed_experts", "num_experts")
    top_k = _int(cfg, "num_experts_per_tok")
    grouped = method != "greedy"
    n_group = _int(cfg, "n_group", default=1) if grouped else 1
    topk_group = _int(cfg, "topk_group", default=1) if grouped else 1
    if experts % n_group or topk_group > n_group:
        raise FamilyConfigError(f"n_group {n_group} / topk_group {topk_group}: n_group must divide n_routed_experts "
                                f"{experts} and topk_group be at most n_group")
    if top_k > topk_group * (experts // n_group):
        raise FamilyConfigError(f"num_experts_per_tok {top_k} exceeds the experts of topk_group {topk_group} groups "
                                f"({topk_group * (experts // n_group)})")
    if method == "noaux_tc" and experts // n_group < 2:
        raise FamilyConfigError(f"n_group {n_group}: noaux_tc ranks groups by their two best experts; "
                                f"each group needs at least 2 of the {experts}")
    normalize = bool(cfg.get("norm_topk_prob", v3))
    if normalize and not v3:
        raise FamilyConfigError("norm_topk_prob true is not supported for deepseek_v2 (transformers' model "
                                "never renormalizes); supported: false")
    scaling = cfg.get("routed_scaling_factor", 1.0)
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not scaling > 0:
        raise FamilyConfigError(f"routed_scaling_factor {scaling!r} must be a positive number")
    return {"num_experts": experts, "num_experts_per_tok": top_k, "router_scoring": scoring, "router_topk": method,
            "n_group": n_group, "topk_group": topk_group, "routed_scaling_factor": float(scaling),
            "norm_topk_prob": normalize, "router_correction_bias": v3}


def _dense_layers(cfg: dict, layers: int) -> tuple:
    first = cfg.get("first_k_dense_replace") or 0
    freq = cfg.get("moe_layer_freq") or 1
    for key, v in (("first_k_dense_replace", first), ("moe_layer_freq", freq)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise FamilyConfigError(f"{key} {v!r} must be a non-negative integer")
    dense = tuple(i for i in range(layers) if i < first or i % freq)
    if len(dense) == layers:
        raise FamilyConfigError(f"first_k_dense_replace {first} / moe_layer_freq {freq} leave no sparse layer")
    return dense


def deepseek_fields(cfg: dict, v3: bool) -> dict:
    if cfg.get("attention_bias"):
        raise FamilyConfigError("attention_bias true is not supported for multi-head latent attention; supported: false")
    if v3 and cfg.get("rope_interleave", True) is not True:
        raise FamilyConfigError(f"rope_interleave {cfg['rope_interleave']!r} is not supported; supported: true")
    heads = _int(cfg, "num_attention_heads")
    nope, rope, v = (_int(cfg, k) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    if rope % 2:
        raise FamilyConfigError(f"qk_rope_head_dim {rope} must be even")
    q_lora = cfg.get("q_lora_rank")
    layers = _int(cfg, "num_hidden_layers")
    shared = int(cfg.get("n_shared_experts") or 0)
    inter = _int(cfg, "moe_intermediate_size")
    return {"activation": activation(cfg), "num_kv_heads": heads, "head_dim": nope + rope, "rotary_dim": rope,
            "kv_lora_rank": _int(cfg, "kv_lora_rank"), "q_lora_rank": 0 if q_lora is None else _int(cfg, "q_lora_rank"),
            "qk_nope_head_dim": nope, "qk_rope_head_dim": rope, "v_head_dim": v,
            "attention_scale": _softmax_scale(cfg, nope + rope),
            "moe_intermediate_size": inter, "shared_expert_intermediate_size": shared * inter,
            "shared_expert_gate": False, "dense_layers": _dense_layers(cfg, layers), **_router_fields(cfg, v3)}


DEEPSEEK_V2 = Family("deepseek_v2", ("deepseek_v2",), hf_fields=lambda cfg: deepseek_fields(cfg, False),
                     shared_expert_name="shared_experts", rope_interleaved=True, float32_router=True)
DEEPSEEK_V3 = Family("deepseek_v3", ("deepseek_v3",), hf_fields=lambda cfg: deepseek_fields(cfg, True),
                     shared_expert_name="shared_experts", rope_interleaved=True, float32_router=True)
