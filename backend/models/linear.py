"""Linear layers the model is built from. Quantized variants register here by method name.

Every linear module maps x (..., in_features) -> (..., out_features) and owns its tensors as
buffers, named as they are stored in the engine's safetensors (e.g. `weight`, `bias`).
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

import torch
from torch import nn


class DenseLinear(nn.Module):
    """Plain float linear: y = x W^T (+ b)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 layer_quant=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=dtype))
        self.register_buffer("bias", torch.empty(out_features, dtype=dtype) if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight, self.bias)


# method name (LayerQuant.method) -> constructor with DenseLinear's signature
LINEAR_REGISTRY: Dict[str, Callable[..., nn.Module]] = {"none": DenseLinear}


def register_linear(method: str, ctor: Callable[..., nn.Module]) -> None:
    LINEAR_REGISTRY[method] = ctor


def make_linear(in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                layer_quant: Optional[object] = None) -> nn.Module:
    """Build the linear layer that `layer_quant` (a LayerQuant or None) asks for."""
    method = getattr(layer_quant, "method", "none") if layer_quant is not None else "none"
    if method not in LINEAR_REGISTRY:
        # Quantized layers live in tritium.backend.quant; importing it registers them.
        from .. import quant  # noqa: F401  (import registers the quantized classes)
    if method not in LINEAR_REGISTRY:
        raise ValueError(f"linear quantization method {method!r} not supported; "
                         f"supported: {', '.join(sorted(LINEAR_REGISTRY))}")
    return LINEAR_REGISTRY[method](in_features, out_features, bias, dtype, layer_quant)
