"""The gated MLP block: down(act(gate(x)) * up(x)), with gate and up fused in one GEMM.

A mixin of DecoderLayer (flat engine names `layers.{i}.gate_up_proj.*`, `layers.{i}.down_proj.*`).
The MLP is the layer's pluggable part: a layer class that mixes in another block with the same
two methods (`_init_mlp`, `mlp`) replaces it (mixture-of-experts layers do).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tritium.kernels import ops

from .linear import make_linear


def gelu_tanh_mul(x: torch.Tensor) -> torch.Tensor:
    """x (..., 2n) = [gate | up] -> gelu_tanh(gate) * up (Gemma's gelu_pytorch_tanh)."""
    n = x.shape[-1] // 2
    return F.gelu(x[..., :n], approximate="tanh") * x[..., n:]


def gelu_mul(x: torch.Tensor) -> torch.Tensor:
    """x (..., 2n) = [gate | up] -> gelu(gate) * up (the exact erf GELU)."""
    n = x.shape[-1] // 2
    return F.gelu(x[..., :n]) * x[..., n:]


ACTIVATIONS = {"silu": ops.silu_mul, "gelu_tanh": gelu_tanh_mul, "gelu": gelu_mul}


class GatedMLP:
    def _init_mlp(self, cfg, idx: int, dtype: torch.dtype) -> None:
        m = cfg.model
        q = cfg.quantization.layers
        self.act_mul = ACTIVATIONS[m.activation]
        self.gate_up_proj = make_linear(m.hidden_size, 2 * m.intermediate_size, m.mlp_bias, dtype,
                                        q.get(f"layers.{idx}.gate_up_proj"))
        self.down_proj = make_linear(m.intermediate_size, m.hidden_size, m.mlp_bias, dtype,
                                     q.get(f"layers.{idx}.down_proj"))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """(T, hidden) -> (T, hidden), this rank's partial sum under TP."""
        return self.down_proj(self.act_mul(self.gate_up_proj(x)))
