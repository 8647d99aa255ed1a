"""FP8 (E4M3) weights with one float32 scale per output channel, and the inverse.

Layout (the engine's `fp8` layout):
    qweight float8_e4m3fn (N, K), scales float32 (N,);   w[n, k] = float(qweight[n, k]) * scales[n]
The scale maps each row's amax onto E4M3's largest finite value (448).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from tritium.kernels.quant_layouts import dequantize_rowwise

from .param16 import param16, param16_dtype

FP8_E4M3_MAX = 448.0


def has_float8() -> bool:
    """Whether this torch build has the float8_e4m3fn dtype."""
    return hasattr(torch, "float8_e4m3fn")


def fp8_scales(w: torch.Tensor) -> torch.Tensor:
    """Per-output-channel scales (N,) float32 that map each row's amax of w (N, K) onto 448."""
    return (w.float().abs().amax(dim=1) / FP8_E4M3_MAX).clamp_min(1e-12)


def round_fp8(x: torch.Tensor) -> torch.Tensor:
    """Nearest E4M3 value (round half to even, saturating at +-448), as float32."""
    return x.float().clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).float()


def quantize_fp8(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Float weight (N, K) -> (qweight float8_e4m3fn (N, K), scales float32 (N,)), by rounding
    each w / scale to the nearest E4M3 value."""
    if not has_float8():
        raise ValueError("quantization 'fp8' needs a torch build with float8_e4m3fn")
    scales = fp8_scales(w)
    q = (w.float() / scales[:, None]).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scales


def dequantize_fp8(qweight: torch.Tensor, scales: torch.Tensor,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of quantize_fp8: float weight (N, K)."""
    return dequantize_rowwise(qweight, scales, dtype)


# ---- group-wise fp8 (LayerQuant.group_size set; kernels/quant_layouts.py FP8_GROUPED_LAYOUT) ----

def fp8_group_params(w: torch.Tensor, group_size: int, asymmetric: bool
                     ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Scales and zeros (N, K // G) (zeros None when symmetric) of w (N, K) in groups of G input
    channels, as stored: float16 (bfloat16 past float16's range; param16.py); see
    quantize_fp8_grouped for the choices."""
    n, k = w.shape
    if group_size <= 0 or k % group_size:
        raise ValueError(f"group_size {group_size} must divide in_features {k}")
    wg = w.float().reshape(n, k // group_size, group_size)
    amax = wg.abs().amax(dim=2).clamp_min(1e-12)
    if not asymmetric:
        s = amax / FP8_E4M3_MAX
        return param16(s, param16_dtype(s), positive=True), None
    lo, hi = wg.amin(dim=2), wg.amax(dim=2)
    dtype = param16_dtype(amax, lo, hi)
    # candidates (scale, zero), each rounded to 16 bits (param16.py) before its error is scored:
    # the group's [min, max] onto 0..15 with zero = min (integers up to 16 are exact in E4M3, so a
    # Q4_1 block's d * q + m, d and m float16, is reproduced exactly), amax onto 8 with zero 0 (a
    # Q4_0 block's d * (q - 8)), [min, max] onto E4M3's [-448, 448] around the midpoint, and the
    # symmetric amax / 448.
    s4 = (hi - lo) / 15
    s8 = (hi - lo) / (2 * FP8_E4M3_MAX)
    zero = torch.zeros_like(amax)
    cands = [(s4, lo), (amax / 8, zero), (s8, (hi + lo) / 2), (amax / FP8_E4M3_MAX, zero)]
    best_err = best_s = best_z = None
    for s, z in cands:
        s, z = param16(s, dtype, positive=True).float(), param16(z, dtype).float()
        codes = round_fp8((wg - z[:, :, None]) / s[:, :, None])
        err = ((codes * s[:, :, None] + z[:, :, None] - wg) ** 2).sum(dim=2)
        if best_err is None:
            best_err, best_s, best_z = err, s, z
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_s, best_z = torch.where(better, s, best_s), torch.where(better, z, best_z)
    return best_s.to(dtype), best_z.to(dtype)
    return best_s, best_z


def quantize_fp8_grouped(w: torch.Tensor, group_size: int, asymmetric: bool = False
                         ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Float weight (N, K) -> (qweight float8_e4m3fn (N, K), scales float16 (K // G, N), zeros
    float16 (K // G, N) or None), rounding each (w - zero) / scale to the nearest E4M3 value.

    Symmetric: scale = group amax / 448. Asymmetric (source-grid aware): per group the least-error
    of [min, max] onto 0..15 (exact for a Q4_1 block), amax onto 8 (exact for Q4_0), [min, max]
    onto [-448, 448], and the symmetric choice. A Q8_0 block (128 levels) has no exact E4M3 form."""
    if not has_float8():
        raise ValueError("quantization 'fp8' needs a torch build with float8_e4m3fn")
    n, k = w.shape
    s, z = fp8_group_params(w, group_size, asymmetric)
    se = s.float().repeat_interleave(group_size, dim=1)
    ze = z.float().repeat_interleave(group_size, dim=1) if z is not None else 0.0
    q = ((w.float() - ze) / se).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q, s.t().contiguous(), None if z is None else z.t().contiguous()
