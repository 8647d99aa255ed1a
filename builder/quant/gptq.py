"""GPTQ (Frantar et al., "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers", 2022) for group-wise asymmetric INT4.

Per layer, with H = 2 X X^T / n over calibration inputs X (K, n): quantize the weight one input
column at a time and spread each column's rounding error over the columns not yet quantized,
weighted by the Cholesky factor of H^-1 (the Optimal Brain Surgeon update). Updates are applied
lazily in blocks of 128 columns; H is dampened by 1% of its mean diagonal. With act-order
(desc_act) columns go in order of decreasing H diagonal and g_idx records each column's group.
With static groups (the "static_groups" option of GPTQ implementations) every group's
(scale, zero) is fixed up front from the original weight's column block k // G, so act-order
changes only the processing order, groups stay contiguous and no g_idx is needed.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from tritium.kernels.quant_layouts import pack_int4

from ..build_threads import column_loop_threads, torch_threads
from .quantize_int4 import int4_codes, int4_params, int4_params_mse, int4_params_sym, int4_params_sym_mse


class HessianAccumulator:
    """Running H = 2/n * sum_i x_i x_i^T over the rows x_i of every batch added."""

    def __init__(self, in_features: int):
        self.sum = torch.zeros(in_features, in_features, dtype=torch.float32)
        self.count = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        self.sum.addmm_(x.t(), x)
        self.count += x.shape[0]

    def hessian(self) -> torch.Tensor:
        return self.sum * (2.0 / max(self.count, 1))


def zero_dead_inputs(W: torch.Tensor, H: torch.Tensor) -> None:
    """In place: an input that is always zero (H_kk = 0) gets H_kk = 1 and weight 0; any weight
    is exact for it, and H stays invertible."""
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0


def inverse_hessian_factor(H: torch.Tensor, damp_percent: float) -> torch.Tensor:
    """Dampens H in place (damp_percent of its mean diagonal added to the diagonal) and returns
    the upper Cholesky factor of H^-1: row i holds the OBS update weights for column i onwards."""
    H.diagonal().add_(damp_percent * torch.mean(torch.diag(H)))
    return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)


def gptq_quantize(w: torch.Tensor, hessian: torch.Tensor, group_size: int, act_order: bool = False,
                  block_size: int = 128, damp_percent: float = 0.01, mse: bool = True,
                  static_groups: bool = False, symmetric: bool = False
                  ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """GPTQ-quantize a float weight (N, K) given its input Hessian (K, K).

    Returns (qweight uint8 (N, K//2), scales (K//G, N), zeros (K//G, N), g_idx int32 (K,) or None),
    in the engine's int4 layout (see quantize_int4.py). mse=True picks each group's (scale, zero)
    by a clipping grid search (the reference code's `mse` option) instead of min/max.
    static_groups=True: group params come from the original columns k // G (before any error
    feedback) and, with act_order, g_idx is None because the groups are the contiguous ones.
    symmetric=True: the symmetric grid (int4_params_sym, zeros all 0).
    """
    W = w.float().clone()
    n, k = W.shape
    if k % group_size:
        raise ValueError(f"group_size {group_size} must divide in_features {k}")
    H = hessian.float().clone()
    zero_dead_inputs(W, H)
    if symmetric:
        params = int4_params_sym_mse if mse else int4_params_sym
    else:
        params = int4_params_mse if mse else int4_params
    scales = torch.empty(k // group_size, n)
    zeros = torch.empty(k // group_size, n)
    if static_groups:
        for g in range(k // group_size):
            scales[g], zeros[g] = params(W[:, g * group_size:(g + 1) * group_size])
    perm = None
    if act_order:
        perm = torch.argsort(torch.diag(H), descending=True)
        W, H = W[:, perm], H[perm][:, perm]
    Hinv = inverse_hessian_factor(H, damp_percent)
    # Blocks are whole groups, so a group's (scale, zero) is set from its error-updated weights.
    block = max(group_size, (block_size // group_size) * group_size)
    with torch_threads(column_loop_threads(n)):  # thousands of small ops (build_threads.py)
        Q = _gptq_columns(W, Hinv, scales, zeros, params, group_size, block, perm, static_groups)
    g_idx = None
    if act_order:
        inv = torch.argsort(perm)
        Q = Q[:, inv]
        if not static_groups:
            g_idx = (torch.arange(k) // group_size)[inv].to(torch.int32)
    return pack_int4(Q), scales.contiguous(), zeros.contiguous(), g_idx


def _gptq_columns(W, Hinv, scales, zeros, params, group_size: int, block: int, perm, static_groups: bool):
    """GPTQ's column loop over W (N, K) in place: the int4 codes (N, K) uint8; fills scales and
    zeros (K // G, N) unless static_groups (then they are read)."""
    n, k = W.shape
    Q = torch.zeros(n, k, dtype=torch.uint8)
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        W1 = W[:, i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if static_groups:
                g = int(perm[col] if perm is not None else col) // group_size
                s, z = scales[g], zeros[g]
            elif col % group_size == 0:
                g = col // group_size
                scales[g], zeros[g] = params(W1[:, i:i + group_size])
                s, z = scales[g], zeros[g]
            wcol = W1[:, i]
            q = int4_codes(wcol, s, z)
            Q[:, col] = q.to(torch.uint8)
            err = (wcol - ((q - 8.0) * s + z)) / Hinv1[i, i]
            W1[:, i:].sub_(torch.outer(err, Hinv1[i, i:]))
            Err1[:, i] = err
        # Lazy batch update of all later columns (the paper's block trick).
        W[:, i2:].sub_(Err1 @ Hinv[i1:i2, i2:])
    return Q
