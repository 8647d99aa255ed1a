"""The one hook LoRA needs in the model: a wrapper around a linear that adds the step's delta.

attach() wraps each decoder layer's qkv_proj / o_proj / gate_up_proj / down_proj by name, after
the engine weights are loaded (the wrapped linear keeps its own module and buffers, so packing
for oneDNN, quantized kernels and tensor-parallel sharding are untouched). Whatever the base
linear is (float, int8, int4, fp8), the delta is added to its output.
"""
from __future__ import annotations

import torch
from torch import nn

from .adapter import adapted_linears


class LoRALinear(nn.Module):
    """y = base(x) (+ the LoRA delta of the rows whose request has an adapter, this step)."""

    def __init__(self, base: nn.Module, manager, key):
        super().__init__()
        self.base = base
        self.key = key            # (layer index, engine linear name)
        self._manager = manager   # a plain attribute, not a submodule: it owns no model weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self._manager.batch is None:
            return y
        return self._manager.apply(self.key, x, y)


def attach(model: nn.Module, manager) -> int:
    """Wrap the adapter-capable linears of every decoder layer (idempotent; the attention's alone
    on a mixture-of-experts layer). Returns how many."""
    n = 0
    for idx, layer in enumerate(model.layers):
        for name in adapted_linears(manager.model_cfg, idx):
            mod = getattr(layer, name, None)
            want = manager.linear_shape(name)  # this rank's part under tensor parallelism
            base = getattr(mod, "base", mod)
            have = (getattr(base, "in_features", None), getattr(base, "out_features", None))
            if mod is None or (None not in have and have != want):
                raise ValueError(f"LoRA: layers.{idx}.{name} is {have} where the adapters' layout needs {want}; "
                                 f"this model family cannot take adapters yet")
            if isinstance(mod, LoRALinear):
                mod._manager = manager
            else:
                setattr(layer, name, LoRALinear(mod, manager, (idx, name)))
            n += 1
    return n
