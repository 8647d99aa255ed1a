"""Linear layers the model is built from: dense here, quantized ones from tritium.backend.quant.

Every linear module maps x (..., in_features) -> (..., out_features) and owns its tensors as
buffers, named as they are stored in the engine's safetensors (e.g. `weight`, `bias`).
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

import torch
from torch import nn

from ..quant import Fp8Linear, Int4Linear, Int8Linear


def cpu_packing_supported(weight: torch.Tensor) -> bool:
    """True where oneDNN can hold this weight pre-packed: a bf16 weight on a CPU whose torch has
    oneDNN with native bf16 (AVX512-BF16 / AMX)."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()) and \
            hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    except (AttributeError, RuntimeError):
        return False


def pack_for_cpu(weight: torch.Tensor) -> torch.Tensor:
    """The weight (N, K) reordered once into oneDNN's blocked layout (an opaque mkldnn tensor).

    F.linear on a plain bf16 weight lets oneDNN reorder the weight on every call; for decode,
    where a step is a few rows times every weight, that reorder is a large part of the call
    (SmolLM2's 49152 x 576 LM head, one row, one thread: 17.6 ms plain vs 11.3 ms pre-packed)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x (..., K) @ packed^T (+ bias) with a weight from pack_for_cpu."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class DenseLinear(nn.Module):
    """Plain float linear: y = x W^T (+ b).

    For inference on CPU, `pack_for_cpu()` swaps the weight for its oneDNN pre-packed form (same
    bytes, not a copy; `weight` is then None, so code that reads it fails loudly)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 layer_quant=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=dtype))
        self.register_buffer("bias", torch.empty(out_features, dtype=dtype) if bias else None)
        self.packed_weight: Optional[torch.Tensor] = None

    def pack_for_cpu(self) -> bool:
        """Pre-pack the weight for oneDNN where supported (idempotent). Returns whether it did."""
        if self.packed_weight is not None:
            return True
        if self.weight is None or not cpu_packing_supported(self.weight):
            return False
        self.packed_weight = pack_for_cpu(self.weight)
        self.weight = None
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None:
            return packed_linear(x, self.packed_weight, self.bias)
        return torch.nn.functional.linear(x, self.weight, self.bias)


# method name (LayerQuant.method) -> constructor with DenseLinear's signature
LINEAR_CLASSES: Dict[str, Callable[..., nn.Module]] = {
    "none": DenseLinear, "int8": Int8Linear, "fp8": Fp8Linear, "int4": Int4Linear}


def make_linear(in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                layer_quant: Optional[object] = None) -> nn.Module:
    """Build the linear layer that `layer_quant` (a LayerQuant or None) asks for."""
    method = getattr(layer_quant, "method", "none") if layer_quant is not None else "none"
    if method not in LINEAR_CLASSES:
        raise ValueError(f"linear quantization method {method!r} not supported; "
                         f"supported: {', '.join(sorted(LINEAR_CLASSES))}")
    return LINEAR_CLASSES[method](in_features, out_features, bias, dtype, layer_quant)
