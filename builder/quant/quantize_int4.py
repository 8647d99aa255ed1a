"""INT4 weights: group-wise round-to-nearest, symmetric (llama.cpp Q4_0's grid: codes -8..7 times
one scale per group, 4.5 bits per weight at groups of 32) or asymmetric (a scale and a zero per
group, 5 bits), packing, and the inverse.

The layout it writes (the engine's `int4` layout) is defined in tritium.kernels.quant_layouts.
quantize_int4 returns float32 scales and zeros (zeros all 0 when symmetric); the builder stores
the scales (and the asymmetric zeros) as float16.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from tritium.kernels.quant_layouts import pack_int4

# Group sizes torch's packed CPU kernel and the Triton kernel both accept.
SUPPORTED_GROUP_SIZES = (32, 64, 128, 256)
FALLBACK_GROUP_SIZES = (64, 32)


def choose_group_size(in_features: int, requested: int) -> Optional[int]:
    """The requested group size if it divides in_features, else the largest of 64/32 that does
    (smaller than the request); None if nothing fits."""
    for g in (requested,) + tuple(f for f in FALLBACK_GROUP_SIZES if f < requested):
        if in_features % g == 0:
            return g
    return None


def int4_params_sym(w: torch.Tensor, ratio: float = 1.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero = 0) of the symmetric 4-bit grid of each row of w (..., G), llama.cpp Q4_0's
    rule: the value of largest magnitude m (sign kept) lands on code -8, scale d = -m / 8 (so the
    grid is d * (-8..7), reaching |m| on the side of m). ratio < 1 shrinks d (a clipping search).
    The scale is rounded to float16 first (the stored value), so the codes are chosen on the grid
    the engine holds."""
    w = w.float()
    idx = w.abs().argmax(dim=-1, keepdim=True)
    m = torch.gather(w, -1, idx).squeeze(-1)
    d = (-m * ratio / 8.0)
    d = torch.where(d == 0, torch.full_like(d, 1e-10), d)
    d = d.half().float()
    d = torch.where(d == 0, torch.full_like(d, 2.0 ** -24), d)  # below float16's range: its smallest step
    return d, torch.zeros_like(d)


def int4_params_sym_mse(w: torch.Tensor, grid: int = 20, min_ratio: float = 0.5, norm: float = 2.4
                        ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The symmetric grid of int4_params_sym with its scale shrunk by the ratio (1 .. min_ratio)
    that minimises, per row, sum |w - dequant(q)|^norm (as int4_params_mse does for asymmetric)."""
    w = w.float()
    best_err = None
    for i in range(grid):
        r = 1.0 - (1.0 - min_ratio) * i / max(grid - 1, 1)
        scale, zero = int4_params_sym(w, r)
        q = int4_codes(w, scale[..., None], zero[..., None])
        err = ((q - 8.0) * scale[..., None] - w).abs_().pow_(norm).sum(-1)
        if best_err is None:
            best_err, best_s = err, scale
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_s = torch.where(better, scale, best_s)
    return best_s, torch.zeros_like(best_s)


def int4_params(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) of the asymmetric 4-bit grid covering each row of w (..., G) -> (...,), (...,).

    scale = (max - min) / 15; codes q = round((w - min) / scale); zero = min + 8 * scale.
    """
    w = w.float()
    wmin = w.amin(dim=-1)
    wmax = w.amax(dim=-1)
    scale = ((wmax - wmin) / 15.0).clamp_min(1e-10)
    return scale, wmin + 8.0 * scale


def int4_params_mse(w: torch.Tensor, grid: int = 20, min_ratio: float = 0.5, norm: float = 2.4
                    ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) per row of w (..., G) chosen by shrinking the [min, max] range about its
    centre and keeping, per row, the ratio with the smallest sum |w - dequant(q)|^norm (the
    grid search of the GPTQ reference code's `mse` option). Ratio 1 is plain min/max."""
    w = w.float()
    wmin, wmax = w.amin(dim=-1), w.amax(dim=-1)
    centre, half = (wmax + wmin) / 2, (wmax - wmin) / 2
    best_err = torch.full_like(wmin, float("inf"))
    best_s, best_z = torch.empty_like(wmin), torch.empty_like(wmin)
    for i in range(grid):
        r = 1.0 - (1.0 - min_ratio) * i / max(grid - 1, 1)
        lo, hi = centre - r * half, centre + r * half
        scale = ((hi - lo) / 15.0).clamp_min(1e-10)
        zero = lo + 8.0 * scale
        q = int4_codes(w, scale[..., None], zero[..., None])
        err = ((q - 8.0) * scale[..., None] + zero[..., None] - w).abs_().pow_(norm).sum(-1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_s = torch.where(better, scale, best_s)
        best_z = torch.where(better, zero, best_z)
    return best_s, best_z


def int4_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Nearest 4-bit code of w given broadcastable (scale, zero): q = clamp(round((w - zero)/scale) + 8)."""
    return (torch.round((w.float() - zero) / scale) + 8).clamp_(0, 15)


def quantize_int4(w: torch.Tensor, group_size: int,
                  params: Optional[Tuple[torch.Tensor, torch.Tensor]] = None, symmetric: bool = False
                  ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest group-wise INT4 of a float weight (N, K).

    params: optional (scale, zero), each (N, K//G), e.g. from a clipping search; default min/max
    (asymmetric) or int4_params_sym (symmetric=True, zeros all 0).
    Returns (qweight uint8 (N, K//2), scales float32 (K//G, N), zeros float32 (K//G, N)).
    """
    n, k = w.shape
    if k % group_size or k % 2:
        raise ValueError(f"group_size {group_size} must divide in_features {k} (and K must be even)")
    wg = w.float().reshape(n, k // group_size, group_size)
    if params is None:
        params = int4_params_sym(wg) if symmetric else int4_params(wg)
    scale, zero = params     # (N, K//G)
    q = int4_codes(wg, scale[..., None], zero[..., None]).reshape(n, k)
    return pack_int4(q), scale.t().contiguous(), zero.t().contiguous()



