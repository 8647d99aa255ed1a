"""Checks of the ModelConfig fields of DeepSeek's routing and multi-head latent attention (MLA).

Under MLA (DeepSeek-V2 paper, "DeepSeek-V2: A Strong, Economical, and Efficient Mixture-of-Experts
Language Model", 2024) the engine's head_dim is the query/key head size qk_nope_head_dim +
qk_rope_head_dim, rotary_dim the rope part, and num_kv_heads = num_heads, so that tensor
parallelism splits the heads one by one; the paged cache holds kv_lora_rank + qk_rope_head_dim
values per token per layer (ModelConfig.kv_cache_token_values).
"""
from __future__ import annotations

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
