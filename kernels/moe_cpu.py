"""The CPU path of the fused MoE op: only the experts that received tokens are computed.

The T*k (token, slot) pairs are sorted by expert once; each expert that appears runs two GEMMs
over its contiguous run of rows (the Python loop is over the experts present in this step, at
most T*k of them: two for a Mixtral decode step of one sequence, never all E), and the weighted
rows are scattered back with one index_add. Rounding follows transformers' MoE blocks: the
expert output is multiplied by its weight in the activation dtype and summed in that dtype.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .moe_ref import ActMul, ExpertWeights, QuantExperts
from .silu_mul_ref import silu_mul_ref


def _expert(w: ExpertWeights, e: int, dtype: torch.dtype) -> torch.Tensor:
    return w.expert(e, dtype) if isinstance(w, QuantExperts) else w[e]


def fused_moe_cpu(x: torch.Tensor, w_gate_up: ExpertWeights, w_down: ExpertWeights,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  act_mul: ActMul = silu_mul_ref, b_gate_up: Optional[torch.Tensor] = None,
                  b_down: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Same contract as moe_ref.fused_moe_ref (biases optional). A quantized expert (QuantExperts:
    int8, int4, mxfp4) is dequantized when it has tokens, then runs the float GEMM; idle experts
    are never read."""
    t, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    rows = x[order // k]  # (T*k, H), grouped by expert
    weights = topk_weights.reshape(-1)[order].to(x.dtype).unsqueeze(1)
    hidden = w_down.shape[1]
    ys = torch.empty(rows.shape[0], hidden, dtype=x.dtype, device=x.device)
    start = 0
    for e, c in zip(experts.tolist(), counts.tolist()):
        r = slice(start, start + c)
        bg = None if b_gate_up is None else b_gate_up[e].to(x.dtype)
        bd = None if b_down is None else b_down[e].to(x.dtype)
        ys[r] = F.linear(act_mul(F.linear(rows[r], _expert(w_gate_up, e, x.dtype), bg)), _expert(w_down, e, x.dtype), bd)
        start += c
    out = torch.zeros(t, hidden, dtype=x.dtype, device=x.device)
    return out.index_add_(0, order // k, ys * weights)
