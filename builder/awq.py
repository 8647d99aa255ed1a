"""AWQ (Lin et al., "AWQ: Activation-aware Weight Quantization for LLM Compression and
Acceleration", 2023): per-input-channel scales s = mean|x|^alpha protect the weights that meet
large activations. For each group of linears sharing an input, alpha is grid-searched on
calibration inputs to minimise the output error of the group-quantized layer; the chosen s is
multiplied into the weight columns and divided out of the previous op (folded), so the float
function is unchanged and only the rounding is redistributed.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch

from .quantize_int4 import int4_codes, int4_params
from .quantize_int8 import bf16_ceil, int8_codes, int8_row_scales


def fake_quantize_int4(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """Quantize-dequantize (N, K) with group-wise asymmetric RTN (same grid as quantize_int4)."""
    n, k = w.shape
    wg = w.float().reshape(n, k // group_size, group_size)
    scale, zero = int4_params(wg)
    q = int4_codes(wg, scale[..., None], zero[..., None])
    return ((q - 8.0) * scale[..., None] + zero[..., None]).reshape(n, k)


def fake_quantize_int8_rows(w: torch.Tensor) -> torch.Tensor:
    """Quantize-dequantize (N, K) on quantize_int8's grid (symmetric, one scale per row)."""
    s = int8_row_scales(w)
    return int8_codes(w, s) * s[:, None]


def awq_search_scale(weights: List[torch.Tensor], x: torch.Tensor, x_mean_abs: torch.Tensor,
                     group_size: Optional[int], n_grid: int = 20,
                     fake_quant: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
                     ) -> Tuple[torch.Tensor, float, List[float]]:
    """Grid-search alpha in s = mean|x|^alpha for linears sharing input x (n_tokens, K).

    weights: float (N_i, K) matrices; x_mean_abs: (K,) per-channel mean |x| over calibration.
    fake_quant: the grid searched on (default: int4 groups of group_size).
    Returns (s (K,), best alpha, loss per grid point); alpha = 0 (s = 1) is plain RTN.
    """
    if fake_quant is None:
        def fake_quant(w):
            return fake_quantize_int4(w, group_size)
    W = torch.cat([w.float() for w in weights], dim=0)
    x = x.float()
    ref = x @ W.t()
    stat = x_mean_abs.float().clamp_min(1e-5)
    losses, best = [], (float("inf"), None, 0.0)
    for r in range(n_grid):
        alpha = r / n_grid
        s = stat.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()  # centre the scales around 1 (as the paper's code does)
        wq = fake_quant(W * s) / s
        loss = (x @ wq.t() - ref).pow(2).mean().item()
        losses.append(loss)
        if loss < best[0]:
            best = (loss, s, alpha)
    return best[1], best[2], losses


def awq_clip_rows_int8(w: torch.Tensor, hessian: torch.Tensor,
                       ratios=(1.0, 0.97, 0.94, 0.91, 0.88, 0.85, 0.8, 0.75, 0.7)) -> torch.Tensor:
    """AWQ's weight clipping search on the symmetric per-row INT8 grid: each row's clip range
    shrinks to the ratio of its amax minimising that row's output error e^T H e (H = X^T X over
    the calibration inputs it will see). Returns the per-row scales (N,), quantize_int8's layout;
    ratio 1.0 (plain amax / 127) is in the grid, so no row does worse than round-to-nearest."""
    wf = w.float()
    base = int8_row_scales(wf)
    best_err, best = None, None
    for r in ratios:
        s = bf16_ceil(base * r)  # base is already a bfloat16 value: ratio 1.0 keeps it
        d = int8_codes(wf, s) * s[:, None] - wf
        err = ((d @ hessian) * d).sum(dim=1)
        if best is None:
            best_err, best = err, s
        else:
            better = err < best_err
            best_err, best = torch.where(better, err, best_err), torch.where(better, s, best)
    return best


def pooled_head_stat(x_mean_abs: torch.Tensor, num_heads: int, num_kv_heads: int,
                     head_dim: int) -> torch.Tensor:
    """For o_proj under GQA: average the per-channel statistic over the query heads that share a
    KV head, expanded back to (num_heads * head_dim,), so that s can be folded into v's rows."""
    group = num_heads // num_kv_heads
    pooled = x_mean_abs.view(num_kv_heads, group, head_dim).mean(dim=1, keepdim=True)
    return pooled.expand(num_kv_heads, group, head_dim).reshape(-1)
