"""Quantized experts: each expert's matrices quantized by the dense linears' own quantizers
(quant_layers.quantize_weight: int8 / fp8 per output channel, int4 group-wise asymmetric),
stacked per expert into the layouts kernels/moe_ref.QuantExperts reads.

The plan gets one entry per sparse layer and projection, `layers.{i}.experts.gate_up` (K = hidden)
and `layers.{i}.experts.down` (K = moe_intermediate_size), in place of the dense gate_up_proj /
down_proj a sparse layer does not have; --exclude-modules matches those names too. Routers and a
shared expert stay float. int8 and int4-rtn round to nearest (no calibration). int4-gptq and fp8
(with a tokenizer) run GPTQ per expert on the Hessians of the calibration tokens routed to that
expert (moe_calibration.py, which also says what an expert that few tokens reach gets); int4
GPTQ experts use act-order with static groups, so their layout needs no g_idx. AWQ is refused
for MoE models (convert_moe.check_moe_build).
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from tritium.backend.config import EngineConfig, LayerQuant

from .quant_layers import quantize_weight
from .quant_plan import excluded
from .quantize_int4 import choose_group_size

PROJECTIONS = ("gate_up", "down")


def moe_plan(cfg: EngineConfig, plan: Dict[str, LayerQuant], o) -> Dict[str, LayerQuant]:
    """The plan with the sparse layers' dense MLP entries replaced by per-projection expert entries."""
    m = cfg.model
    out = dict(plan)
    for i in range(m.num_layers):
        if not m.sparse(i):
            continue
        out.pop(f"layers.{i}.gate_up_proj", None)
        out.pop(f"layers.{i}.down_proj", None)
        for proj, k in (("gate_up", m.hidden_size), ("down", m.moe_intermediate_size)):
            name = f"layers.{i}.experts.{proj}"
            if excluded(name, o.exclude_modules):
                out[name] = LayerQuant("none")
            elif o.quantization in ("int8", "fp8"):
                out[name] = LayerQuant(o.quantization, group_reason="per output channel, per expert")
            else:  # int4-rtn, int4-gptq
                g = choose_group_size(k, o.group_size)
                out[name] = LayerQuant("none", group_reason=f"no int4 group size divides {k}") if g is None else \
                    LayerQuant("int4", group_size=g, group_reason=f"{o.group_size} requested" if g == o.group_size
                               else f"{o.group_size} does not divide {k} -> {g}",
                               act_order=False, static_groups=o.quantization == "int4-gptq")
    return out


def quantize_experts(cfg: EngineConfig, i: int, layer, new: dict, plan: Dict[str, LayerQuant], method: str,
                     hessians: Optional[dict] = None) -> dict:
    """Quantize layer i's expert stacks in `new` (engine tensors) and load the dequantized weights
    into the float `layer`, so that later layers calibrate on them. hessians: the finished
    moe_calibration.ExpertHessians of the layer (GPTQ per expert), None to round to nearest.
    Returns report entries."""
    report = {}
    rtn_method = "int4-rtn" if method == "int4-gptq" else method
    for proj in PROJECTIONS:
        name = f"layers.{i}.experts.{proj}"
        lq = plan.get(name)
        if lq is None or lq.method == "none":
            continue
        w = new.pop(f"{name}_weight")
        hs = hessians[proj] if hessians is not None else [None] * w.shape[0]
        parts = [quantize_weight(w[e].float(), lq, method if h is not None else rtn_method,
                                 None if h is None else {"H": h}) for e, h in enumerate(hs)]
        for suffix in parts[0][0]:
            new[f"{name}_{suffix}"] = torch.stack([p[0][suffix] for p in parts])
        deq = torch.stack([p[1] for p in parts])
        layer.experts._buffers[f"{proj}_weight"] = deq.to(w.dtype)
        report[name] = {"method": lq.method, "group_size": lq.group_size, "group_reason": lq.group_reason,
                        "rel_weight_error": float((deq - w.float()).norm() / w.float().norm().clamp_min(1e-12))}
        if hessians is not None:
            num = den = 0.0
            for e, h in enumerate(hs):  # ||(Q - W) X||^2 / ||W X||^2 over each expert's own tokens
                if h is not None:
                    d, wf = deq[e] - w[e].float(), w[e].float()
                    num += float(((d @ h.hessian()) * d).sum())
                    den += float(((wf @ h.hessian()) * wf).sum())
            report[name]["rel_output_error"] = num / max(den, 1e-30)
            report[name]["rounding"] = "GPTQ per expert (its routed calibration tokens)"
    if hessians is not None:
        report[f"layers.{i}.experts"] = hessians["report"]
    return report
