"""INT8 weights: symmetric, one scale per output channel, and the inverse.

Layout (the engine's `int8` layout; torch's `aten._weight_int8pack_mm` reads it as is):
    qweight int8 (N, K), scales float32 (N,);   w[n, k] = qweight[n, k] * scales[n]
"""
from __future__ import annotations

from typing import Tuple

import torch

INT8_LAYOUT = "qweight int8 (N, K); scales float32 (N,); w[n,k] = qweight[n,k] * scales[n] (symmetric per output channel)"


def quantize_int8(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Float weight (N, K) -> (qweight int8 (N, K), scales float32 (N,)), scale = amax / 127."""
    wf = w.float()
    scales = (wf.abs().amax(dim=1) / 127.0).clamp_min(1e-10)
    q = torch.round(wf / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of quantize_int8: float weight (N, K)."""
    return (qweight.float() * scales.float()[:, None]).to(dtype)
