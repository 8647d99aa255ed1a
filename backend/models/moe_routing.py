"""DeepSeek's MoE routers: sigmoid or softmax scores, group-limited top-k, a correction bias
used to choose experts only, and routed_scaling_factor (ModelConfig.router_* fields).

    greedy                the k best scores (Mixtral, Qwen-MoE, OLMoE, DeepSeek-V2 "greedy")
    group_limited_greedy  DeepSeek-V2: the experts in n_group groups; the topk_group groups with
                          the best single score stay, the k best scores among their experts win
    noaux_tc              DeepSeek-V3 ("auxiliary-loss-free load balancing", DeepSeek-V3 technical
                          report, 2024): choice scores = sigmoid scores + correction bias; groups
                          ranked by the sum of their two best choice scores; the k best choice
                          scores among the topk_group best groups win. The weights are the
                          *uncorrected* scores of the chosen experts.
Then, when norm_topk_prob, the k weights are divided by their sum (+1e-20 for sigmoid scores, as
DeepSeek-V3's reference does), and multiplied by routed_scaling_factor. All in float32. DeepSeek's
router itself runs in float32 whatever the engine dtype (transformers keeps `gate.weight` and the
bias in float32 and casts the hidden state up): a float32 `router.weight`, stored so by the
builder; the weights go to the experts in the activation dtype.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn


def _group_mask(choice: torch.Tensor, n_group: int, topk_group: int, method: str) -> torch.Tensor:
    """(T, E) bool: the experts of the topk_group best groups."""
    t, e = choice.shape
    grouped = choice.view(t, n_group, e // n_group)
    if method == "noaux_tc":
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
    else:
        group_scores = grouped.max(dim=-1).values
    keep = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
    return mask.unsqueeze(-1).expand(t, n_group, e // n_group).reshape(t, e)


def route_grouped(logits: torch.Tensor, top_k: int, scoring: str, method: str, n_group: int, topk_group: int,
                  normalize: bool, scaling: float, bias: Optional[torch.Tensor] = None
                  ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Router logits (T, E) -> (weights (T, k) in the logits' dtype, expert ids (T, k) int64)."""
    lf = logits.float()
    if scoring == "sigmoid":
        scores = lf.sigmoid()
    elif scoring == "softmax":
        scores = torch.softmax(lf, dim=-1)
    else:
        raise ValueError(f"router_scoring {scoring!r} is not supported; supported: softmax, sigmoid")
    choice = scores if bias is None else scores + bias.float()
    if method in ("group_limited_greedy", "noaux_tc") and topk_group < n_group:
        # noaux_tc masks with -inf (the bias may make scores negative); V2's greedy variant with 0
        fill = float("-inf") if method == "noaux_tc" else 0.0
        choice = choice.masked_fill(~_group_mask(choice, n_group, topk_group, method), fill)
    elif method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise ValueError(f"router_topk {method!r} is not supported; supported: greedy, group_limited_greedy, noaux_tc")
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if scoring == "sigmoid" else 0.0))
    if scaling != 1.0:
        weights = weights * scaling
    return weights.to(logits.dtype), ids


def route(layer, logits: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The routing a SparseMoE layer's config asks for (its attributes set by init_routing)."""
    weights, ids = route_grouped(logits, layer.top_k, layer.router_scoring, layer.router_topk, layer.n_group,
                                 layer.topk_group, layer.norm_topk_prob, layer.routed_scaling_factor,
                                 layer.router.correction_bias)
    return weights.to(layer.route_dtype), ids


# Architectures whose router runs in float32 (transformers' DeepSeek models do).
FLOAT32_ROUTERS = ("deepseek_v2", "deepseek_v3")


def deepseek_router(m) -> bool:
    """Whether ModelConfig `m` routes other than softmax greedy top-k in the engine dtype (then
    route() serves it, with a float32 router)."""
    return m.router_scoring != "softmax" or m.router_topk != "greedy" or m.routed_scaling_factor != 1.0 \
        or m.router_correction_bias or m.architecture in FLOAT32_ROUTERS


class Float32Router(nn.Module):
    """x (T, hidden) -> float32 logits (T, E) from a float32 `weight` (and DeepSeek-V3's
    `correction_bias`, used by the choice only)."""

    def __init__(self, hidden: int, experts: int, bias: bool):
        super().__init__()
        self.register_buffer("weight", torch.empty(experts, hidden, dtype=torch.float32))
        self.register_buffer("correction_bias", torch.empty(experts, dtype=torch.float32) if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x.float(), self.weight)


def init_routing(layer, m, dtype: torch.dtype) -> None:
    """Set a SparseMoE layer's routing attributes; DeepSeek's routers become Float32Router."""
    layer.router_scoring, layer.router_topk = m.router_scoring, m.router_topk
    layer.n_group, layer.topk_group, layer.routed_scaling_factor = m.n_group, m.topk_group, m.routed_scaling_factor
    layer.grouped_router = deepseek_router(m)
    layer.route_dtype = dtype
    if layer.grouped_router:
        layer.router = Float32Router(m.hidden_size, m.num_experts, m.router_correction_bias)
