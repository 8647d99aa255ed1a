"""Checks of the ModelConfig fields of mixture-of-experts models (validate_moe), DeepSeek's routing
and multi-head latent attention (MLA).

Under MLA (DeepSeek-V2 paper, "DeepSeek-V2: A Strong, Economical, and Efficient Mixture-of-Experts
Language Model", 2024) the engine's head_dim is the query/key head size qk_nope_head_dim +
qk_rope_head_dim, rotary_dim the rope part, and num_kv_heads = num_heads, so that tensor
parallelism splits the heads one by one; the paged cache holds kv_lora_rank + qk_rope_head_dim
values per token per layer (ModelConfig.kv_cache_token_values).
"""
from __future__ import annotations

# How an MoE router scores experts (softmax; DeepSeek-V3's sigmoid) and chooses its top-k
SUPPORTED_ROUTER_SCORING = ("softmax", "sigmoid")
# How an MoE router chooses its top-k experts (backend/models/moe_routing.py).
SUPPORTED_ROUTER_TOPK = ("greedy", "group_limited_greedy", "noaux_tc")


def o_head_dim(m) -> int:
    """Features per head entering o_proj: v_head_dim under MLA, else head_dim."""
    return m.v_head_dim if m.kv_lora_rank else m.head_dim


def kv_cache_token_values(m) -> int:
    """Values the paged KV cache holds per token per layer: the latent plus the rope part under
    MLA, K and V of every KV head otherwise."""
    return m.kv_lora_rank + m.qk_rope_head_dim if m.kv_lora_rank else 2 * m.num_kv_heads * m.head_dim


def validate_routing(m, err) -> None:
    """The top-k method and expert groups of an MoE model; raises `err` naming the field."""
    if m.router_topk not in SUPPORTED_ROUTER_TOPK:
        raise err(f"model.router_topk {m.router_topk!r} is not supported; supported: {', '.join(SUPPORTED_ROUTER_TOPK)}")
    if m.n_group < 1 or m.num_experts % m.n_group or not 1 <= m.topk_group <= m.n_group:
        raise err(f"model.n_group {m.n_group} / topk_group {m.topk_group}: n_group must divide num_experts "
                  f"{m.num_experts} and topk_group be in [1, n_group]")
    if m.router_topk == "noaux_tc" and m.num_experts // m.n_group < 2:
        raise err(f"model.router_topk 'noaux_tc' ranks groups by their two best experts; n_group {m.n_group} "
                  f"leaves {m.num_experts // m.n_group} per group")
    if m.num_experts_per_tok > m.topk_group * (m.num_experts // m.n_group):
        raise err(f"model.num_experts_per_tok {m.num_experts_per_tok} exceeds the experts of topk_group "
                  f"{m.topk_group} groups ({m.topk_group * (m.num_experts // m.n_group)})")


def validate_mla(m, kv_cache, err) -> None:
    """The MLA fields and the cache options MLA allows; raises `err` naming the field."""
    for name in ("kv_lora_rank", "q_lora_rank"):
        v = getattr(m, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise err(f"model.{name} must be an integer >= 0 (0: none), got {v!r}")
    if not m.kv_lora_rank:
        return
    for name in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if getattr(m, name) <= 0:
            raise err(f"model.{name} must be > 0 with kv_lora_rank set, got {getattr(m, name)}")
    if m.head_dim != m.qk_nope_head_dim + m.qk_rope_head_dim or m.rotary_dim != m.qk_rope_head_dim \
            or m.num_kv_heads != m.num_heads:
        raise err(f"model: multi-head latent attention needs head_dim = qk_nope_head_dim + qk_rope_head_dim, "
                  f"rotary_dim = qk_rope_head_dim and num_kv_heads = num_heads; got head_dim {m.head_dim}, "
                  f"rotary_dim {m.rotary_dim}, num_kv_heads {m.num_kv_heads}")
    if kv_cache.dtype != "auto" or kv_cache.rotation != "none":
        raise err(f"kv_cache.dtype {kv_cache.dtype!r} / rotation {kv_cache.rotation!r}: the latent cache of "
                  f"multi-head latent attention is stored in the engine dtype; allowed: dtype 'auto', rotation 'none'")


def validate_moe(cfg, err) -> None:
    """The mixture-of-experts fields of an EngineConfig; raises `err` naming the field."""
    m = cfg.model
    if m.num_experts == 0:
        return
    if m.router_scoring not in SUPPORTED_ROUTER_SCORING:
        raise err(f"model.router_scoring {m.router_scoring!r} is not supported; supported: "
              f"{', '.join(SUPPORTED_ROUTER_SCORING)}")
    validate_routing(m, err)
    if not 0 < m.num_experts_per_tok <= m.num_experts:
        raise err(f"model.num_experts_per_tok {m.num_experts_per_tok} must be in "
              f"[1, num_experts {m.num_experts}]")
    if m.moe_intermediate_size <= 0:
        raise err(f"model.moe_intermediate_size must be > 0, got {m.moe_intermediate_size}")
    bad = [i for i in m.dense_layers if not 0 <= i < m.num_layers]
    if bad:
        raise err(f"model.dense_layers entry {bad[0]} is not a layer index (0..{m.num_layers - 1})")
    if m.swiglu_limit is not None and not m.swiglu_limit > 0:
        raise err(f"model.swiglu_limit {m.swiglu_limit!r} must be > 0 or null")
    quantized = [k for k, lq in cfg.quantization.layers.items()
                 if ".experts." in k and getattr(lq, "method", "none") != "none"]
    if cfg.tensor_parallel_size > 1 and quantized:
        raise err(f"tensor_parallel_size > 1 with quantized experts ({quantized[0]}) is not "
              f"supported; allowed: float experts, or tensor_parallel_size 1")
