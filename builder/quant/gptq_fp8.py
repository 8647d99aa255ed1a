"""GPTQ error feedback on the FP8 (E4M3) grid, per-output-channel scales.

GPTQ (Frantar et al., "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers", 2022) quantizes a weight one input column at a time and spreads each column's
rounding error over the columns not yet quantized, weighted by the Cholesky factor of H^-1
(H = 2 X X^T / n over calibration inputs), so that ||W X - Q X|| rather than ||W - Q|| is what
the rounding minimises. Nothing in the update depends on the grid being uniform: here each
column is rounded to E4M3 (3 mantissa bits) times the row's scale, fixed up front. With
mse_scale (the default) each row's scale is searched over amax / 448 x 2^(j/16), j = -4..15
(slight clipping up to almost an octave of headroom) for the least H-diagonal-weighted rounding
error of the row: how the E4M3 grid lines up with a row's values matters when the weights sit on
a coarser grid themselves (SmolLM2's come from a 4-bit GGUF). Without it the row's amax maps
onto 448. Columns go in order of decreasing H diagonal (the paper's act-order); with one scale
per row the order needs no g_idx, so the stored layout is quantize_fp8's unchanged.
"""
from __future__ import annotations

from typing import Tuple

import torch

from .gptq_rows import gptq_rows
from .quantize_fp8 import FP8_E4M3_MAX, fp8_group_params, fp8_scales, round_fp8

SCALE_STEPS = tuple(2.0 ** (j / 16) for j in range(-4, 16))  # multiples of amax / 448 searched


def fp8_mse_scales(w: torch.Tensor, importance: torch.Tensor) -> torch.Tensor:
    """Per-row scales (N,) of w (N, K) minimising sum_k importance[k] * (w - fp8(w / s) * s)^2
    over s = amax / 448 * SCALE_STEPS (importance: e.g. the Hessian diagonal, E[x_k^2])."""
    base = fp8_scales(w)
    best_err, best = None, base.clone()
    for step in SCALE_STEPS:
        s = base * step
        err = ((round_fp8(w / s[:, None]) * s[:, None] - w) ** 2 * importance).sum(dim=1)
        if best_err is None:
            best_err, best = err, s
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best = torch.where(better, s, best)
    return best


def gptq_fp8_quantize(w: torch.Tensor, hessian: torch.Tensor, block_size: int = 128,
                      damp_percent: float = 0.01, mse_scale: bool = True
                      ) -> Tuple[torch.Tensor, torch.Tensor]:
    """GPTQ-quantize a float weight (N, K) to E4M3 given its input Hessian (K, K).

    Returns (qweight float8_e4m3fn (N, K), scales float32 (N,)), the layout of quantize_fp8."""
    w = w.float()
    if hessian.shape != (w.shape[1], w.shape[1]):
        raise ValueError(f"hessian: shape {tuple(hessian.shape)}, weight needs ({w.shape[1]}, {w.shape[1]})")
    scales = fp8_mse_scales(w, torch.diag(hessian.float())) if mse_scale else fp8_scales(w)
    Q = gptq_rows(w, hessian, scales, round_fp8, block_size, damp_percent)
    assert Q.abs().max() <= FP8_E4M3_MAX
    return Q.to(torch.float8_e4m3fn), scales


def gptq_fp8_grouped(w: torch.Tensor, hessian: torch.Tensor, group_size: int, asymmetric: bool,
                     block_size: int = 128, damp_percent: float = 0.01):
    """GPTQ on the E4M3 grid with group-wise (scale, zero) fixed up front by fp8_group_params
    (static groups, act-order column order). A group whose best choice is the integer grid
    0..15 (a 4-bit source block) is rounded on that grid, so GPTQ keeps it exact when the
    weight lies on it. Returns quantize_fp8_grouped's (qweight, scales (K/G, N), zeros or None)."""
    w = w.float()
    s, z = fp8_group_params(w, group_size, asymmetric)  # 16-bit, as stored
    se = s.float().repeat_interleave(group_size, dim=1)
    ze = z.float().repeat_interleave(group_size, dim=1) if z is not None else None
    Q = gptq_rows(w, hessian, se, round_fp8, block_size, damp_percent, zeros=ze)
    return Q.to(torch.float8_e4m3fn), s.t().contiguous(), None if z is None else z.t().contiguous()
