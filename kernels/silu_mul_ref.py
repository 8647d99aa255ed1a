"""SiLU-and-mul: the gated MLP activation of Llama-family models.

x has shape (..., 2 * n) holding [gate | up]; out = silu(gate) * up, shape (..., n).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Reference SiLU-and-mul over the last dimension split in two halves."""
    n = x.shape[-1] // 2
    return F.silu(x[..., :n]) * x[..., n:]
