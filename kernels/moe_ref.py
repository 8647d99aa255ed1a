"""Mixture-of-experts feed-forward: the torch reference and the token sort the kernels share.

Each token t goes to top_k experts e = topk_ids[t, j] with weight topk_weights[t, j]; expert e is
a gated MLP with stacked weights w_gate_up[e] (2I, H) = [gate; up] rows and w_down[e] (H, I):
    out[t] = sum_j topk_weights[t, j] * w_down[e] @ act(w_gate_up[e] @ x[t]),   e = topk_ids[t, j]
gpt-oss adds per-expert biases (b_gate_up[e] (2I,) after the first GEMM, b_down[e] (H,) after the
second, before the routing weight) and its clamped SwiGLU as `act` (swiglu_clamped_ref).
The reference is that formula written over gathered weights (every (token, slot) pair gets its
own copy of its expert's matrices): slow and memory-hungry, but with nothing sorted or grouped,
so the sorted / grouped paths (moe_cpu.py, moe_triton.py) are checked against a different form.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple, Union

import torch

from .mxfp4 import dequantize_mxfp4
from .quant_layouts import dequantize_int4, dequantize_rowwise
from .silu_mul_ref import silu_mul_ref

ActMul = Callable[[torch.Tensor], torch.Tensor]  # (..., 2I) [gate | up] -> (..., I)


@dataclass
class QuantExperts:
    """E quantized expert matrices (N, K), each in a per-linear layout of quant_layouts.py, stacked
    on a leading expert dimension: int8  qweight int8 (E, N, K), scales float32 (E, N);
    fp8  qweight float8_e4m3fn (E, N, K), scales float32 (E, N) (one scale per output channel);
    int4  qweight uint8 (E, N, K // 2), scales / zeros float32 (E, K // G, N);
    mxfp4  qweight uint8 (E, N, K // 2), scales uint8 (E, N, K // 32) (kernels/mxfp4.py)."""
    method: str  # "int8" | "fp8" | "int4" | "mxfp4"
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: Optional[torch.Tensor] = None
    group_size: Optional[int] = None

    @property
    def shape(self) -> Tuple[int, int, int]:
        e, n, k = self.qweight.shape
        return e, n, k * (2 if self.method in ("int4", "mxfp4") else 1)

    def expert(self, e: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Expert e's float weight (N, K)."""
        if self.method in ("int8", "fp8"):
            return dequantize_rowwise(self.qweight[e], self.scales[e], dtype)
        if self.method == "mxfp4":
            return dequantize_mxfp4(self.qweight[e], self.scales[e], dtype)
        return dequantize_int4(self.qweight[e], self.scales[e], self.zeros[e], self.group_size, dtype=dtype)

    def dense(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.stack([self.expert(e, dtype) for e in range(self.shape[0])])


ExpertWeights = Union[torch.Tensor, QuantExperts]  # float (E, N, K) or quantized


def swiglu_clamped_ref(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's expert activation on x (..., 2I) = [gate | up] -> (..., I):
    gate <- min(gate, limit), up <- clamp(up, -limit, limit), (up + 1) * gate * sigmoid(alpha * gate)."""
    n = x.shape[-1] // 2
    gate = x[..., :n].clamp(max=limit)
    up = x[..., n:].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def fused_moe_ref(x: torch.Tensor, w_gate_up: ExpertWeights, w_down: ExpertWeights,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  act_mul: ActMul = silu_mul_ref, b_gate_up: Optional[torch.Tensor] = None,
                  b_down: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x (T, H), w_gate_up (E, 2I, H), w_down (E, H, I), topk_weights (T, k), topk_ids (T, k),
    optional biases b_gate_up (E, 2I), b_down (E, H) -> (T, H) in x's dtype; products in float32.
    Quantized experts are dequantized first."""
    w_gate_up = w_gate_up.dense() if isinstance(w_gate_up, QuantExperts) else w_gate_up
    w_down = w_down.dense() if isinstance(w_down, QuantExperts) else w_down
    xf = x.float()
    g = w_gate_up[topk_ids].float()  # (T, k, 2I, H)
    d = w_down[topk_ids].float()  # (T, k, H, I)
    c1 = torch.einsum("th,tkoh->tko", xf, g)
    if b_gate_up is not None:
        c1 = c1 + b_gate_up[topk_ids].float()
    h = act_mul(c1)  # (T, k, I)
    y = torch.einsum("tki,tkhi->tkh", h, d)  # (T, k, H)
    if b_down is not None:
        y = y + b_down[topk_ids].float()
    return (y * topk_weights.float().unsqueeze(-1)).sum(1).to(x.dtype)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sort the T*k (token, slot) pairs by expert and pad each expert's run to a multiple of
    block_m, so that every block of block_m rows belongs to one expert (one grouped-GEMM tile).

    Returns sorted_ids (P,) int32: flat pair ids t * k + j, padding = T * k (a sentinel no row
    has), and block_expert (P // block_m,) int32: each block's expert, -1 for the unused tail.
    P = T*k + min(E, T*k) * (block_m - 1) rounded up to block_m: an upper bound known without a
    device-to-host sync (the real padded total depends on the counts)."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    n = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    cap = n + min(num_experts, n) * (block_m - 1)
    cap = (cap + block_m - 1) // block_m * block_m
    order = torch.argsort(flat, stable=True)
    e_sorted = flat[order]
    start = torch.cumsum(counts, 0) - counts  # first sorted index of each expert
    start_padded = torch.cumsum(padded, 0) - padded
    pos = start_padded[e_sorted] + torch.arange(n, device=flat.device) - start[e_sorted]
    sorted_ids = torch.full((cap,), n, dtype=torch.int32, device=flat.device)
    sorted_ids[pos] = order.to(torch.int32)
    block_expert = torch.full((cap // block_m,), -1, dtype=torch.int32, device=flat.device)
    used = torch.repeat_interleave(torch.arange(num_experts, device=flat.device), padded // block_m)
    block_expert[: used.numel()] = used.to(torch.int32)
    return sorted_ids, block_expert
