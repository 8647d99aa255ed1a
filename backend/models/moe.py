"""Mixture-of-experts MLP: a router, E experts run by the fused MoE op, an optional shared expert.

A drop-in for GatedMLP (same `_init_mlp` / `mlp` methods, see mlp.py): MoEDecoderLayer is
DecoderLayer with this block first in its bases. Layers listed in ModelConfig.dense_layers
(Qwen3-MoE's mlp_only_layers, decoder_sparse_step) keep the dense GatedMLP.
Routing (Mixtral, Qwen2/3-MoE, OLMoE): p = softmax(x W_r^T) in float32 over the experts, the
top-k of p (renormalized to sum to one when norm_topk_prob), cast to the activation dtype as
transformers does. Qwen2-MoE adds a shared expert, every token's, scaled by sigmoid(x . w_g).
gpt-oss (ModelConfig.router_topk_then_softmax): the router has a bias, the top-k of the logits are
taken first and a softmax runs over those k; experts carry biases and use the clamped SwiGLU
(swiglu_limit / swiglu_alpha, kernels/moe_ref.swiglu_clamped_ref).
Engine tensors of a sparse layer i:
    layers.{i}.router.weight                  (E, hidden)     (.bias (E,) with router_bias)
    layers.{i}.experts.gate_up_weight         (E, 2 I, hidden)   [gate; up] rows per expert
    layers.{i}.experts.down_weight            (E, hidden, I)
    layers.{i}.experts.{gate_up,down}_bias    (E, 2 I), (E, hidden)   with expert_bias
    (quantized experts: layers.{i}.experts.{gate_up,down}_{qweight,scales[,zeros]}, see Experts)
    layers.{i}.shared_expert.{gate_up_proj,down_proj}.weight, layers.{i}.shared_expert_gate.weight
"""
from __future__ import annotations

from functools import partial
from typing import List, Optional, Tuple

import torch
from torch import nn

from tritium.kernels import ops
from tritium.kernels.moe_ref import QuantExperts, swiglu_clamped_ref

from .layer import DecoderLayer
from .linear import DenseLinear, make_linear
from .mla import LatentAttention
from .mlp import ACTIVATIONS, GatedMLP
from .moe_routing import init_routing, route


def route_softmax_topk(logits: torch.Tensor, top_k: int, normalize: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """Router logits (T, E) -> (weights (T, k) in the logits' dtype, expert ids (T, k) int64)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


def route_topk_softmax(logits: torch.Tensor, top_k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss: the top-k logits (T, k), then a softmax over them in the logits' dtype."""
    top, ids = torch.topk(logits, top_k, dim=-1)
    return torch.softmax(top, dim=-1), ids


class Experts(nn.Module):
    """The stacked expert weights one fused-MoE call reads, per projection ("gate_up", "down")
    float `{proj}_weight` (E, N, K) or, when QuantConfig.layers["layers.{i}.experts.{proj}"] says
    so, the per-linear int8 / fp8 (per output channel) / int4 layout stacked per expert: `{proj}_qweight`, `{proj}_scales`
    (and int4's `{proj}_zeros`), see kernels/moe_ref.QuantExperts."""

    def __init__(self, cfg, idx: int, dtype: torch.dtype):
        super().__init__()
        m = cfg.model
        e, h, inter = m.num_experts, m.hidden_size, m.moe_intermediate_size
        self.quant = {}
        for proj, n, k in (("gate_up", 2 * inter, h), ("down", h, inter)):
            lq = cfg.quantization.layers.get(f"layers.{idx}.experts.{proj}")
            method = getattr(lq, "method", "none")
            if method == "none":
                self.register_buffer(f"{proj}_weight", torch.empty(e, n, k, dtype=dtype))
            elif method in ("int8", "fp8"):
                code = torch.int8 if method == "int8" else torch.float8_e4m3fn
                self.register_buffer(f"{proj}_qweight", torch.empty(e, n, k, dtype=code))
                self.register_buffer(f"{proj}_scales", torch.empty(e, n, dtype=torch.float32))
            elif method == "mxfp4":  # gpt-oss's checkpoint format, kept as stored (kernels/mxfp4.py)
                self.register_buffer(f"{proj}_qweight", torch.empty(e, n, k // 2, dtype=torch.uint8))
                self.register_buffer(f"{proj}_scales", torch.empty(e, n, k // 32, dtype=torch.uint8))
            elif method == "int4":
                g = lq.group_size
                self.register_buffer(f"{proj}_qweight", torch.empty(e, n, k // 2, dtype=torch.uint8))
                self.register_buffer(f"{proj}_scales", torch.empty(e, k // g, n, dtype=torch.float32))
                self.register_buffer(f"{proj}_zeros", torch.empty(e, k // g, n, dtype=torch.float32))
            else:
                raise ValueError(f"quantization.layers.layers.{idx}.experts.{proj}.method {method!r} not supported; "
                                 f"allowed: none, int8, fp8, int4, mxfp4")
            self.quant[proj] = (method, getattr(lq, "group_size", None))
            # gpt-oss: each expert's bias, added before the routing weight
            self.register_buffer(f"{proj}_bias", torch.empty(e, n, dtype=dtype) if m.expert_bias else None)

    def weights(self, proj: str):
        """What ops.fused_moe takes for this projection: a float tensor or a QuantExperts."""
        method, group = self.quant[proj]
        if method == "none":
            return getattr(self, f"{proj}_weight")
        return QuantExperts(method, getattr(self, f"{proj}_qweight"), getattr(self, f"{proj}_scales"),
                            getattr(self, f"{proj}_zeros", None), group)


class SharedExpert(nn.Module):
    """A gated MLP every token goes through (Qwen2-MoE's shared_expert)."""

    def __init__(self, cfg, idx: int, inter: int, dtype: torch.dtype):
        super().__init__()
        m, q = cfg.model, cfg.quantization.layers
        self.act_mul = ACTIVATIONS[m.activation]
        self.gate_up_proj = make_linear(m.hidden_size, 2 * inter, False, dtype,
                                        q.get(f"layers.{idx}.shared_expert.gate_up_proj"))
        self.down_proj = make_linear(inter, m.hidden_size, False, dtype, q.get(f"layers.{idx}.shared_expert.down_proj"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_mul(self.gate_up_proj(x)))


class SparseMoE(GatedMLP):
    def _init_mlp(self, cfg, idx: int, dtype: torch.dtype) -> None:
        m = cfg.model
        self.sparse = m.sparse(idx)
        if not self.sparse:
            GatedMLP._init_mlp(self, cfg, idx, dtype)
            return
        self.act_mul = ACTIVATIONS[m.activation] if m.swiglu_limit is None else \
            partial(swiglu_clamped_ref, alpha=m.swiglu_alpha, limit=m.swiglu_limit)
        self.top_k, self.norm_topk_prob = m.num_experts_per_tok, m.norm_topk_prob
        self.topk_then_softmax = m.router_topk_then_softmax
        self.router = DenseLinear(m.hidden_size, m.num_experts, m.router_bias, dtype)
        init_routing(self, m, dtype)  # DeepSeek's grouped / sigmoid routing (moe_routing.py)
        self.experts = Experts(cfg, idx, dtype)
        si = m.shared_expert_intermediate_size
        self.shared_expert = SharedExpert(cfg, idx, si, dtype) if si else None
        self.shared_expert_gate = DenseLinear(m.hidden_size, 1, False, dtype) if si and m.shared_expert_gate else None
        # Load-balance counters: tokens routed to each expert since the last read (moe_metrics).
        self.expert_tokens = torch.zeros(m.num_experts, dtype=torch.int64)

    def select_experts(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Route x (T, hidden): (weights (T, k), expert ids (T, k), router scores (T, E) float32:
        softmax probabilities, or DeepSeek's sigmoid scores; the builder's per-expert calibration
        ranks tokens by them, builder/quant/moe_calibration.py)."""
        logits = self.router(x)
        if self.grouped_router:
            weights, ids = route(self, logits)
        elif self.topk_then_softmax:
            weights, ids = route_topk_softmax(logits, self.top_k)
        else:
            weights, ids = route_softmax_topk(logits, self.top_k, self.norm_topk_prob)
        # gpt-oss ranks by its logits too (top-k then softmax): a softmax over all experts keeps that order
        sigmoid = self.grouped_router and self.router_scoring == "sigmoid"
        return weights, ids, logits.float().sigmoid() if sigmoid else torch.softmax(logits.float(), -1)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        if not self.sparse:
            return GatedMLP.mlp(self, x)
        weights, ids, _ = self.select_experts(x)
        if self.expert_tokens.device != ids.device:
            self.expert_tokens = self.expert_tokens.to(ids.device)
        self.expert_tokens += torch.bincount(ids.reshape(-1), minlength=self.expert_tokens.numel())
        out = ops.fused_moe(x, self.experts.weights("gate_up"), self.experts.weights("down"), weights, ids,
                            self.act_mul, self.experts.gate_up_bias, self.experts.down_bias)
        if self.shared_expert is not None:
            s = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                s = torch.sigmoid(self.shared_expert_gate(x)) * s
            out = out + s
        return out


class MoEDecoderLayer(SparseMoE, DecoderLayer):
    """DecoderLayer whose MLP is SparseMoE (dense where ModelConfig.dense_layers says so)."""


class MLAMoEDecoderLayer(SparseMoE, LatentAttention, DecoderLayer):
    """DeepSeek's layer: multi-head latent attention (mla.py) and SparseMoE."""


def expert_token_counts(model) -> Optional[List[int]]:
    """Tokens routed to each expert so far, summed over the sparse layers (each token counts once
    per layer per chosen expert); None for a dense model. Load balance at a glance: a perfectly
    balanced router gives every expert total / num_experts."""
    counts = [layer.expert_tokens for layer in getattr(model, "layers", ()) if getattr(layer, "sparse", False)]
    if not counts:
        return None
    return torch.stack([c.cpu() for c in counts]).sum(0).tolist()
