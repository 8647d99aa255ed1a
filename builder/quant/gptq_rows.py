"""GPTQ with one fixed scale per output row, on any rounding grid: E4M3 (gptq_fp8.py) and the
symmetric per-row INT8 grid (the LM head of int4 builds, quantize_embeddings).

GPTQ (Frantar et al., "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers", 2022) quantizes a weight one input column at a time and spreads each column's
rounding error over the columns not yet quantized, weighted by the Cholesky factor of H^-1
(H = 2 X X^T / n over calibration inputs), so that ||W X - Q X|| rather than ||W - Q|| is what
the rounding minimises. The update does not depend on the grid: each column is rounded to
`round_codes(column / scales)` times the row scales, fixed up front. Columns go in order of
decreasing H diagonal (the paper's act-order); with one scale per row that order needs no g_idx.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from ..build_threads import column_loop_threads, torch_threads
from .gptq import inverse_hessian_factor, zero_dead_inputs
from .quantize_int8 import int8_row_scales


def gptq_rows(w: torch.Tensor, hessian: torch.Tensor, scales: torch.Tensor,
              round_codes: Callable[[torch.Tensor], torch.Tensor], block_size: int = 128,
              damp_percent: float = 0.01, zeros: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Codes (N, K) float32 of w (N, K) on the grid round_codes(.) * scales[:, None], chosen
    column by column with GPTQ's error feedback under the input Hessian (K, K).

    scales may also be (N, K), one per weight (group-wise scales expanded), with zeros (N, K):
    then column k's grid is round_codes((w - zeros[:, k]) / scales[:, k]) * scales[:, k] + zeros[:, k]
    (group parameters fixed up front: the paper's static groups)."""
    W = w.float().clone()
    n, k = W.shape
    if hessian.shape != (k, k):
        raise ValueError(f"hessian: shape {tuple(hessian.shape)}, weight needs ({k}, {k})")
    H = hessian.float().clone()
    zero_dead_inputs(W, H)
    perm = torch.argsort(torch.diag(H), descending=True)
    W, H = W[:, perm], H[perm][:, perm]
    S = scales.float()[:, perm] if scales.dim() == 2 else None
    Z = zeros.float()[:, perm] if zeros is not None else None
    Hinv = inverse_hessian_factor(H, damp_percent)
    Q = torch.empty(n, k)
    with torch_threads(column_loop_threads(n)):  # thousands of small ops (build_threads.py)
        for i1 in range(0, k, block_size):
            i2 = min(i1 + block_size, k)
            W1 = W[:, i1:i2].clone()
            Err1 = torch.zeros_like(W1)
            Hinv1 = Hinv[i1:i2, i1:i2]
            for i in range(i2 - i1):
                s_col = scales if S is None else S[:, i1 + i]
                z_col = 0.0 if Z is None else Z[:, i1 + i]
                q = round_codes((W1[:, i] - z_col) / s_col)
                Q[:, i1 + i] = q
                err = (W1[:, i] - (q * s_col + z_col)) / Hinv1[i, i]
                W1[:, i:].sub_(torch.outer(err, Hinv1[i, i:]))
                Err1[:, i] = err
            # Lazy batch update of all later columns (the paper's block trick).
            W[:, i2:].sub_(Err1 @ Hinv[i1:i2, i2:])
    return Q[:, torch.argsort(perm)]


def gptq_int8_quantize(w: torch.Tensor, hessian: torch.Tensor, damp_percent: float = 0.01,
                       qmax: int = 127, scales: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """GPTQ on quantize_int8's grid (symmetric, scale = row amax / qmax unless `scales` (N,) are
    given; qmax 31: the int6 embedding's codes -32..31). Returns (qweight int8 (N, K), scales
    float32 (N,)), quantize_int8's layout."""
    scales = int8_row_scales(w, qmax) if scales is None else scales.float()
    lo = -qmax - 1 if qmax != 127 else -127
    q = gptq_rows(w, hessian, scales, lambda x: torch.round(x).clamp_(lo, qmax), damp_percent=damp_percent)
    return q.to(torch.int8), scales


def gptq_int6_grouped(w: torch.Tensor, hessian: torch.Tensor, group_size: int, s16: torch.Tensor,
                      damp_percent: float = 0.01) -> Tuple[torch.Tensor, torch.Tensor]:
    """GPTQ on the int6 grid in symmetric groups of `group_size` with the scales s16 (K // G, N)
    fixed up front (the paper's static groups; codes -32..31). Returns (qweight int8 (N, K), s16)."""
    full = s16.float().t().repeat_interleave(group_size, dim=1)  # (N, K)
    q = gptq_rows(w, hessian, full, lambda x: torch.round(x).clamp_(-32, 31), damp_percent=damp_percent)
    return q.to(torch.int8), s16
