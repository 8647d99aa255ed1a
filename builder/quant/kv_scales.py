"""Per-KV-head scales of a quantized KV cache, chosen from calibration K (after RoPE) and V.

The runtime writes x / scale[head] rounded to the cache dtype and multiplies by the scale when
attention reads it back (kernels/kv_write_ref.py); the scale is the only free parameter.

- FP8 (E4M3) keeps 3 mantissa bits at every magnitude, so the relative rounding error does not
  depend on the scale; what the scale decides is only where values saturate (448) and where
  they turn subnormal (below 2^-6). Scale = FP8_HEADROOM * amax / 448 leaves room for values
  beyond the calibration amax (on SmolLM2, evaluation K/V reached up to 1.34x it) at the cost
  of one binade of subnormals, a range where values are too small to matter.
- INT8 is a uniform grid: clipping the few largest values buys a finer step for all others.
  The clip is searched per head to minimise the mean squared error of the stored values
  (the MSE-optimal clipping of e.g. Banner et al., "Post training 4-bit quantization of
  convolutional networks for rapid-deployment", 2019), over ratios of the amax.
"""
from __future__ import annotations

import torch

FP8_E4M3_MAX = 448.0
INT8_MAX = 127.0
FP8_HEADROOM = 2.0
INT8_CLIP_RATIOS = tuple(0.30 + 0.02 * i for i in range(36))  # 0.30 .. 1.00 of the amax
MAX_SEARCH_ROWS = 4096  # rows of a head's samples scored per clip ratio (strided subsample)
MIN_SCALE = 1e-8        # a head that is all zeros still gets a finite, positive scale

KV_OFFSET_METHODS = {
    "none": "no offsets: K and V are stored as they are (study option: measures what the offsets buy)",
    "mean": ("per-KV-head means of calibration K (after RoPE) and V, subtracted before they are "
             "stored; V's is added back to the attention output"),
    "attention": ("per-KV-head means of calibration K (after RoPE) and V weighted by the attention each "
                  "token receives, subtracted before they are stored; V's is added back to the attention output")}
KV_SCALE_METHODS = {"fp8": f"amax * {FP8_HEADROOM} / 448 per KV head",
                    "int8": "MSE-optimal clip per KV head (search over 0.30..1.00 x amax) / 127"}


def kv_head_offsets(x: torch.Tensor) -> torch.Tensor:
    """Per-KV-head mean (H, D) float32 of calibration K (after RoPE) or V samples (T, H, D).

    The runtime stores K - k_offset and V - v_offset (backend/models/decoder.py). Every score of
    one query then moves by the same q.k_offset, which softmax ignores, and the attention output
    gets v_offset back (the weights sum to 1), so attention is exact in real arithmetic; what
    changes is what the cache has to represent. On SmolLM2 a few low-frequency RoPE channels
    of K carry a large constant part (layer 10: mean -12.9, std 1.9), and E4M3's 3-bit mantissa
    spent on that constant swamps their variation: measured by simulation, fp8 K error (mean KL)
    halves with the offset removed."""
    return x.float().mean(dim=0)


def attention_weighted_offsets(stats: dict, key: str) -> torch.Tensor:
    """Per-KV-head offsets (H, D) float32 for K ('k') or V ('v'): the calibration keys / values
    weighted by the attention they receive (kv_sample_hook's stats 'w', 'kw', 'vw').

    The offset can be any vector (kv_head_offsets), so it can be put where the rounding error
    costs most: a stored key's error moves its score, and a stored value's error moves the
    output, in proportion to the attention it receives; sum_s p_s ||x_s - c||^2 is least at the
    attention-weighted mean. It pulls the offset toward the attention sink (the first token,
    which most heads attend to and which E4M3 otherwise stores with its full 3-bit relative error)."""
    return (stats[key + "w"] / stats["w"].clamp_min(1e-12)[:, None]).float()


def kv_head_scales(x: torch.Tensor, kv_cache_dtype: str) -> torch.Tensor:
    """Scales (H,) float32 for calibration samples x (T, H, D) of K (after RoPE) or V.

    kv_cache_dtype: 'fp8' or 'int8'. Raises ValueError for another dtype."""
    if kv_cache_dtype not in KV_SCALE_METHODS:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: allowed {', '.join(KV_SCALE_METHODS)}")
    x = x.float()
    amax = x.abs().amax(dim=(0, 2))
    if kv_cache_dtype == "fp8":
        return (amax * FP8_HEADROOM / FP8_E4M3_MAX).clamp_min(MIN_SCALE)
    rows = x[:: max(1, x.shape[0] // MAX_SEARCH_ROWS)]
    return torch.stack([_int8_mse_scale(rows[:, h], amax[h]) for h in range(x.shape[1])]).clamp_min(MIN_SCALE)


def int8_error(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Sum of squared errors of x stored as round(x / scale) clamped to [-127, 127]."""
    return ((x / scale).round().clamp(-INT8_MAX, INT8_MAX) * scale - x).pow(2).sum()


def _int8_mse_scale(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    if amax == 0:
        return torch.tensor(MIN_SCALE)
    cands = [amax * r / INT8_MAX for r in INT8_CLIP_RATIOS]
    errs = torch.stack([int8_error(x, s) for s in cands])
    return cands[int(torch.argmin(errs))].float()
