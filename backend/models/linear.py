"""Linear layers the model is built from: dense here, quantized ones from tritium.backend.quant.

Every linear module maps x (..., in_features) -> (..., out_features) and owns its tensors as
buffers, named as they are stored in the engine's safetensors (e.g. `weight`, `bias`).
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

import torch
from torch import nn

from tritium.kernels import ops

from ..quant import Fp8Linear, Int4Linear, Int6Linear, Int8Linear


def cpu_packing_supported(weight: torch.Tensor) -> bool:
    """True where a bf16 weight on CPU has a packed kernel (kernels/cpu_linear.py: oneDNN's
    pre-packed GEMM or the native batch-invariant one)."""
    return ops.can_pack_dense_cpu(weight)


def pack_for_cpu(weight: torch.Tensor, deterministic: bool = False):
    """The weight (N, K) in its CPU kernel's form (kernels/cpu_linear.CpuLinear): oneDNN's blocked
    layout where oneDNN is batch-invariant for this K, else the native bf16 GEMM's; the native
    GEMM always with `deterministic`.

    F.linear on a plain bf16 weight lets oneDNN reorder the weight on every call; for decode,
    where a step is a few rows times every weight, that reorder is a large part of the call
    (SmolLM2's 49152 x 576 LM head, one row, one thread: 17.6 ms plain vs 11.3 ms pre-packed)."""
    return ops.pack_cpu_linear("none", {"weight": weight}, weight.dtype, deterministic=deterministic)


def packed_linear(x: torch.Tensor, packed, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x (..., K) @ packed^T (+ bias) with a weight from pack_for_cpu, rounded once to x's dtype."""
    y = ops.cpu_linear(x.reshape(-1, x.shape[-1]), packed, x.dtype).to(x.dtype)
    y = y.reshape(*x.shape[:-1], y.shape[-1])
    return y if bias is None else y + bias


class DenseLinear(nn.Module):
    """Plain float linear: y = x W^T (+ b).

    For inference on CPU, `pack_for_cpu()` swaps the weight for its packed form (`weight` is then
    None, so code that reads it fails loudly)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 layer_quant=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=dtype))
        self.register_buffer("bias", torch.empty(out_features, dtype=dtype) if bias else None)
        self.packed_weight = None

    def pack_for_cpu(self, deterministic: bool = False) -> bool:
        """Pack the weight for its CPU kernel where there is one (idempotent). Returns whether it did."""
        if self.packed_weight is not None:
            return True
        if self.weight is None or not cpu_packing_supported(self.weight):
            return False
        self.packed_weight = pack_for_cpu(self.weight, deterministic)
        self.weight = None
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None:
            return packed_linear(x, self.packed_weight, self.bias)
        return torch.nn.functional.linear(x, self.weight, self.bias)


# method name (LayerQuant.method) -> constructor with DenseLinear's signature
LINEAR_CLASSES: Dict[str, Callable[..., nn.Module]] = {
    "none": DenseLinear, "int8": Int8Linear, "fp8": Fp8Linear, "int4": Int4Linear, "int6": Int6Linear}


def make_linear(in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                layer_quant: Optional[object] = None) -> nn.Module:
    """Build the linear layer that `layer_quant` (a LayerQuant or None) asks for."""
    method = getattr(layer_quant, "method", "none") if layer_quant is not None else "none"
    if method not in LINEAR_CLASSES:
        raise ValueError(f"linear quantization method {method!r} not supported; "
                         f"supported: {', '.join(sorted(LINEAR_CLASSES))}")
    return LINEAR_CLASSES[method](in_features, out_features, bias, dtype, layer_quant)
