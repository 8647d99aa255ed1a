"""AWQ (Lin et al., "AWQ: Activation-aware Weight Quantization for LLM Compression and
Acceleration", 2023): per-input-channel scales s = mean|x|^alpha protect the weights that meet
large activations. For each group of linears sharing an input, alpha is grid-searched on
calibration inputs to minimise the output error of the group-quantized layer; the chosen s is
multiplied into the weight columns and divided out of the previous op (folded), so the float
function is unchanged and only the rounding is redistributed.

`awq_search` is the int4 builder's search: its loss is the layer's output error over every
calibration token, written through the inputs' second moment H = X^T X (the loss
||X (Q(W s)/s - W)^T||^2 = sum_n d_n^T H d_n), and besides the paper's s = mean|x|^alpha it tries
the "duo" scales s = mean|x|^alpha / mean|w_hat|^(1 - alpha) (w_hat: weights over their group's
max, AutoAWQ's and llm-compressor's default). `awq_clip_int4` is the paper's weight clipping
search (its reference code's auto_clip) on the int4 grid, run after the scales are folded.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from .quantize_int4 import int4_codes, int4_params, int4_params_sym
from .quantize_int8 import bf16_ceil, int8_codes, int8_row_scales


def fake_quantize_int4(w: torch.Tensor, group_size: int, symmetric: bool = False) -> torch.Tensor:
    """Quantize-dequantize (N, K) with group-wise RTN (same grid as quantize_int4)."""
    n, k = w.shape
    wg = w.float().reshape(n, k // group_size, group_size)
    scale, zero = int4_params_sym(wg) if symmetric else int4_params(wg)
    q = int4_codes(wg, scale[..., None], zero[..., None])
    return ((q - 8.0) * scale[..., None] + zero[..., None]).reshape(n, k)


def fake_quantize_int8_rows(w: torch.Tensor) -> torch.Tensor:
    """Quantize-dequantize (N, K) on quantize_int8's grid (symmetric, one scale per row)."""
    s = int8_row_scales(w)
    return int8_codes(w, s) * s[:, None]


def awq_search_scale(weights: List[torch.Tensor], x: torch.Tensor, x_mean_abs: torch.Tensor,
                     group_size: Optional[int], n_grid: int = 20,
                     fake_quant: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                     symmetric: bool = False) -> Tuple[torch.Tensor, float, List[float]]:
    """Grid-search alpha in s = mean|x|^alpha for linears sharing input x (n_tokens, K).

    weights: float (N_i, K) matrices; x_mean_abs: (K,) per-channel mean |x| over calibration.
    fake_quant: the grid searched on (default: int4 groups of group_size).
    Returns (s (K,), best alpha, loss per grid point); alpha = 0 (s = 1) is plain RTN.
    """
    if fake_quant is None:
        def fake_quant(w):
            return fake_quantize_int4(w, group_size, symmetric)
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


def group_weight_mean(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per input channel mean of |w| over its group's max |w| (K,): the weight statistic of duo
    scaling (AutoAWQ's `duo_scaling`, llm-compressor's default)."""
    n, k = w.shape
    wg = w.float().abs().reshape(n, k // group_size, group_size)
    wg = wg / wg.amax(dim=-1, keepdim=True).clamp_min(1e-12)
    return wg.reshape(n, k).mean(dim=0)


def hessian_loss(d: torch.Tensor, hessian: torch.Tensor) -> float:
    """sum_n d_n^T H d_n: the squared output error of a weight error d (N, K) over the
    calibration inputs whose second moment is H (K, K)."""
    return float(((d @ hessian) * d).sum())


@dataclasses.dataclass
class AwqChoice:
    """The outcome of awq_search."""
    scales: torch.Tensor   # (K,) multiplied into the weight columns, divided out of the previous op
    alpha: float           # exponent of the activation statistic
    duo: bool              # True: s = x^alpha / w^(1 - alpha); False: s = x^alpha
    loss: float            # output error of the chosen scales
    rtn_loss: float        # output error of plain RTN (alpha = 0)


def awq_search(weights: Sequence[torch.Tensor], hessian: torch.Tensor, x_mean_abs: torch.Tensor,
               group_size: int, n_grid: int = 20, duo: bool = True,
               w_mean: Optional[torch.Tensor] = None, symmetric: bool = False) -> AwqChoice:
    """AWQ's scale search for linears sharing one input, scored on the output error over all
    calibration tokens (hessian: H = X^T X of that input, (K, K)); x_mean_abs: mean |x| (K,).

    Tries s = x^alpha for alpha in 0, 1/n_grid, ..., (n_grid-1)/n_grid and, with duo, also
    s = x^alpha / w^(1-alpha) (w: w_mean, default group_weight_mean of the weights; o_proj under
    GQA passes it pooled like its x statistic); scales are centred so that max(s) * min(s) = 1. alpha = 0 without duo is plain RTN, so the result is never worse than
    RTN on the calibration inputs."""
    W = torch.cat([w.float() for w in weights], dim=0)
    H = hessian.float()
    xs = x_mean_abs.float().clamp_min(1e-5)
    if duo:
        ws = (group_weight_mean(W, group_size) if w_mean is None else w_mean.float()).clamp_min(1e-5)
    best = None
    rtn_loss = None
    for r in range(n_grid):
        alpha = r / n_grid
        for use_duo in ((False, True) if duo else (False,)):
            s = xs.pow(alpha) / ws.pow(1 - alpha) if use_duo else xs.pow(alpha)
            s = s / (s.max() * s.min()).sqrt()
            loss = hessian_loss(fake_quantize_int4(W * s, group_size, symmetric) / s - W, H)
            if r == 0 and not use_duo:
                rtn_loss = loss
            if best is None or loss < best.loss:
                best = AwqChoice(s, alpha, use_duo, loss, 0.0)
    best.rtn_loss = rtn_loss
    return best


CLIP_RATIOS = tuple(1.0 - i / 20 for i in range(11))  # 1.0 down to 0.5, as the paper's code


def awq_clip_int4(w: torch.Tensor, hessian: torch.Tensor, group_size: int,
                  ratios: Sequence[float] = CLIP_RATIOS, clip_rows: Optional[torch.Tensor] = None,
                  symmetric: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """AWQ's weight clipping search on the asymmetric int4 grid: each (row, group) is clamped to
    [-r amax, r amax] before its min/max grid is fitted, with r picked per (row, group) to minimise
    that group's output error d^T H_gg d (H_gg: the group's diagonal block of H = X^T X; the
    paper's code measures the same error on sampled tokens, group by group).

    w: (N, K) float weight (already AWQ-scaled; H must then be of the scaled inputs).
    clip_rows: optional bool (N,), rows searched; the others keep r = 1 (the paper's code skips
    q and k, whose error the output loss does not see through the attention softmax).
    Returns (scale, zero), each (N, K // group_size), for quantize_int4(params=...); r = 1 is
    plain min/max, so no group's error exceeds round-to-nearest's. symmetric: the grid of
    int4_params_sym (zero 0), its scale shrunk by r instead."""
    n, k = w.shape
    ng = k // group_size
    wg = w.float().reshape(n, ng, group_size)
    H = hessian.float().reshape(ng, group_size, ng, group_size)
    Hg = torch.stack([H[g, :, g, :] for g in range(ng)])              # (ng, G, G)
    amax = wg.abs().amax(dim=-1, keepdim=True)
    best_err = best_s = best_z = None
    for r in (1.0,) + tuple(r for r in ratios if r != 1.0):
        if symmetric:
            scale, zero = int4_params_sym(wg, r)
        else:
            scale, zero = int4_params(wg.clamp(-r * amax, r * amax))
        q = int4_codes(wg, scale[..., None], zero[..., None])
        d = (q - 8.0) * scale[..., None] + zero[..., None] - wg
        err = torch.einsum("ngi,gij,ngj->ng", d, Hg, d)
        if best_err is None:
            best_err, best_s, best_z = err, scale, zero
            continue
        better = err < best_err
        if clip_rows is not None:
            better &= clip_rows[:, None]
        best_err = torch.where(better, err, best_err)
        best_s = torch.where(better, scale, best_s)
        best_z = torch.where(better, zero, best_z)
    return best_s, best_z
