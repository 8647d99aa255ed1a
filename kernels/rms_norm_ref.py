"""RMSNorm with an optional fused residual add.

out = x / sqrt(mean(x^2) + eps) * weight, computed in float32 (as HF Llama does).
With a residual, x = x + residual first and the sum is returned as the new residual.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Reference RMSNorm. Returns (normed, residual_out); residual_out = x (+ residual)."""
    if residual is not None:
        x = x + residual
    residual_out = x
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype), residual_out


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """rms_norm_ref's contract in three ATen calls (the CPU path): torch's fused rms_norm
    normalizes in float32 and rounds once to x's dtype, as the reference does, then the weight
    multiplies in x's dtype. About half the dispatches of the reference."""
    if residual is not None:
        x = x + residual
    y = F.rms_norm(x, (x.shape[-1],), eps=eps)
    return y.mul_(weight), x
