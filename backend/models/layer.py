"""One decoder layer: the attention and MLP blocks with the family's norm placement.

The residual stream travels as (hidden, residual) with stream = hidden + residual, so that the
add is fused into the next RMSNorm (ops.rms_norm(x, w, eps, residual) returns the normed sum
and the sum). Placements (ModelConfig.norm_placement):
    pre       x = x + attn(n1(x));             x = x + mlp(n2(x))              Llama, Qwen, Phi-3, Granite
    sandwich  x = x + n1o(attn(n1(x)));        x = x + n2o(mlp(n2(x)))         Gemma 2 / 3
    post      x = x + n1o(attn(x));            x = x + n2o(mlp(x))             OLMo 2
with engine norms n1 = input_norm, n2 = post_attn_norm, n1o = attn_out_norm, n2o = mlp_out_norm.
Granite's residual_multiplier scales each block's output before the add.
"""
from __future__ import annotations

import torch
from torch import nn

from tritium.kernels import ops

from .attention import PagedAttention
from .mlp import GatedMLP

# Which norms each placement has (engine names, each a (hidden,) weight)
PLACEMENT_NORMS = {"pre": ("input_norm", "post_attn_norm"),
                   "sandwich": ("input_norm", "attn_out_norm", "post_attn_norm", "mlp_out_norm"),
                   "post": ("attn_out_norm", "mlp_out_norm")}
NORM_NAMES = ("input_norm", "post_attn_norm", "attn_out_norm", "mlp_out_norm", "q_norm", "k_norm")


class DecoderLayer(PagedAttention, GatedMLP, nn.Module):
    def __init__(self, cfg, idx: int, dtype: torch.dtype):
        nn.Module.__init__(self)
        m = cfg.model
        self.idx = idx
        self.eps = m.rms_norm_eps
        self.placement = m.norm_placement
        self.residual_multiplier = m.residual_multiplier
        for name in NORM_NAMES[:4]:
            has = name in PLACEMENT_NORMS[m.norm_placement]
            self.register_buffer(f"{name}_weight", torch.empty(m.hidden_size, dtype=dtype) if has else None)
        self._init_attention(cfg, idx, dtype)
        self._init_mlp(cfg, idx, dtype)
        # Tensor parallelism (backend/parallel/comm.py): o_proj and down_proj hold this rank's
        # input features; their partial outputs are summed over the ranks. None on one rank.
        self.tp = None

    def _reduce(self, out: torch.Tensor) -> torch.Tensor:
        if self.tp is not None:
            self.tp.all_reduce(out)
        if self.residual_multiplier != 1.0:
            out = out * self.residual_multiplier
        return out

    def _out_norm(self, out: torch.Tensor, weight) -> torch.Tensor:
        return out if weight is None else ops.rms_norm(out, weight, self.eps)[0]

    def forward(self, positions, hidden, residual, kv_cache, meta, rope):
        """One layer over the step's tokens; `rope` is the step's RopeState (DecoderLM.rope_state).
        Returns the new (hidden, residual)."""
        if self.placement == "post":
            x = hidden if residual is None else hidden + residual
            a = self._out_norm(self._reduce(self.attention(positions, x, kv_cache, meta, rope)), self.attn_out_norm_weight)
            x = x + a
            return self._out_norm(self._reduce(self.mlp(x)), self.mlp_out_norm_weight), x
        x, residual = ops.rms_norm(hidden, self.input_norm_weight, self.eps, residual)
        a = self._out_norm(self._reduce(self.attention(positions, x, kv_cache, meta, rope)), self.attn_out_norm_weight)
        x, residual = ops.rms_norm(a, self.post_attn_norm_weight, self.eps, residual)
        return self._out_norm(self._reduce(self.mlp(x)), self.mlp_out_norm_weight), residual
