"""RMSNorm with an optional fused residual add.

out = x / sqrt(mean(x^2) + eps) * weight, computed in float32 (as HF Llama does).
With a residual, x = x + residual first and the sum is returned as the new residual.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Reference RMSNorm. Returns (normed, residual_out); residual_out = x (+ residual)."""
    if residual is not None:
        x = x + residual
    residual_out = x
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype), residual_out
