"""SmoothQuant (Xiao et al., "SmoothQuant: Accurate and Efficient Post-Training Quantization for
Large Language Models", 2023): move activation outliers into the weights before W8A8 / W4A8.

For a linear y = x W^T whose input channel j has calibration range max|X_j| and weight column
range max|W_:,j|, the smoothing factor is s_j = max|X_j|^alpha / max|W_:,j|^(1 - alpha); the
linear then sees x / s and W diag(s), the same product in exact arithmetic, with the activation
ranges flattened. x / s is folded where it is exact:

    qkv_proj      <- input_norm.weight / s          (RMSNorm's output is linear in its weight)
    gate_up_proj  <- post_attn_norm.weight / s
    o_proj        <- v rows of qkv_proj (and bias) / s, one s per (KV head, dim) shared by the
                     query heads of the group (attention output is linear in V)
    down_proj     <- up rows of gate_up_proj (and bias) / s (act(gate) * up is linear in up)

A linear with no such producer (OLMo 2's post-norm layers have no norm before qkv / gate_up; the
experts of a sparse MoE layer) is left as it is. Every s is computed from the float model's
calibration activations and the float weights, before any rounding.
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch

from .. import calibration as calib
from .quant_layers import LINEARS

DEFAULT_ALPHA = 0.5  # the paper's default migration strength


def smoothing_factors(x_amax: torch.Tensor, w_amax: torch.Tensor, alpha: float) -> torch.Tensor:
    """s_j = max|X_j|^alpha / max|W_j|^(1 - alpha), 1 where either range is zero, kept in [1e-4, 1e4]."""
    x, w = x_amax.float(), w_amax.float()
    ok = (x > 0) & (w > 0)
    s = x.clamp_min(1e-12).pow(alpha) / w.clamp_min(1e-12).pow(1.0 - alpha)
    return torch.where(ok, s.clamp(1e-4, 1e4), torch.ones_like(s))


def _scale_rows(new: dict, name: str, rows: slice, s: torch.Tensor) -> None:
    t = new[name]
    f = t.float().clone()
    f[rows] /= s if f.dim() == 1 else s[:, None]
    new[name] = f.to(t.dtype)


def smooth_layer(cfg, i: int, new: Dict[str, torch.Tensor], x_amax: Dict[str, torch.Tensor], alpha: float,
                 targets) -> Dict[str, dict]:
    """Fold SmoothQuant's factors for layer i's linears in `targets` into `new` (engine tensors,
    replaced not mutated). x_amax: each linear's per-input-channel max |x|. Returns report entries."""
    m = cfg.model
    pre = f"layers.{i}."
    nq, nkv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    w = {lin: new[pre + lin + ".weight"].float() for lin in LINEARS if pre + lin + ".weight" in new}
    factors = {}
    for lin, norm in (("qkv_proj", "input_norm.weight"), ("gate_up_proj", "post_attn_norm.weight")):
        if lin in targets and lin in w and pre + norm in new and lin in x_amax:
            factors[lin] = (smoothing_factors(x_amax[lin], w[lin].abs().amax(0), alpha), norm)
    if "o_proj" in targets and "o_proj" in w and "qkv_proj" in w and "o_proj" in x_amax:
        group = m.num_heads // m.num_kv_heads

        def pool(t):  # (Hq * D,) -> (Hkv * D,): the max over the query heads sharing a KV head
            return t.view(m.num_kv_heads, group, m.head_dim).amax(1).reshape(-1)
        s_kv = smoothing_factors(pool(x_amax["o_proj"]), pool(w["o_proj"].abs().amax(0)), alpha)
        factors["o_proj"] = (s_kv, None)
    if "down_proj" in targets and "down_proj" in w and "gate_up_proj" in w and "down_proj" in x_amax:
        factors["down_proj"] = (smoothing_factors(x_amax["down_proj"], w["down_proj"].abs().amax(0), alpha), None)
    report = {}
    for lin, (s, norm) in factors.items():
        name = pre + lin + ".weight"
        if lin == "o_proj":
            group = m.num_heads // m.num_kv_heads
            full = s.view(m.num_kv_heads, 1, m.head_dim).expand(m.num_kv_heads, group, m.head_dim).reshape(-1)
            new[name] = (new[name].float() * full).to(new[name].dtype)
            _scale_rows(new, pre + "qkv_proj.weight", slice(nq + nkv, nq + 2 * nkv), s)
            if pre + "qkv_proj.bias" in new:
                _scale_rows(new, pre + "qkv_proj.bias", slice(nq + nkv, nq + 2 * nkv), s)
        elif lin == "down_proj":
            new[name] = (new[name].float() * s).to(new[name].dtype)
            _scale_rows(new, pre + "gate_up_proj.weight", slice(m.intermediate_size, None), s)
            if pre + "gate_up_proj.bias" in new:
                _scale_rows(new, pre + "gate_up_proj.bias", slice(m.intermediate_size, None), s)
        else:
            new[name] = (new[name].float() * s).to(new[name].dtype)
            t = new[pre + norm]
            new[pre + norm] = (t.float() / s).to(t.dtype)
        report[pre + lin] = {"smoothquant_factor_range": [float(s.min()), float(s.max())]}
    return report


ACTIVATION_QUANT_CHOICES = ("auto", "none", "int8")  # --activation-quant; auto resolves to none or int8
# the methods Tritium quantizes itself whose integer-dot quality is measured (docs/quantization.md)
INTEGER_DOT_METHODS = ("int8", "int4-rtn", "int4-awq", "int4-gptq")


def check_activation_value(value) -> None:
    """--activation-quant's value; ValueError names the flag and the allowed values."""
    if value not in ACTIVATION_QUANT_CHOICES:
        raise ValueError(f"--activation-quant {value!r} not supported; allowed: {', '.join(ACTIVATION_QUANT_CHOICES)}")


def resolve_activation_quant(activation_quant: str, quantization: str) -> str:
    """--activation-quant auto (the default) -> int8 (W8A8 / W4A8) for the int8 and int4 methods
    Tritium quantizes itself (GGUF or Hugging Face float sources), none everywhere else: no
    quantization, fp8, --quantization auto (its budget is measured weight-only) and imported
    pre-quantized checkpoints (built with --quantization none: SmoothQuant cannot be folded into
    fixed weights). none / int8 are returned as given."""
    check_activation_value(activation_quant)
    if activation_quant != "auto":
        return activation_quant
    return "int8" if quantization in INTEGER_DOT_METHODS else "none"


def check_activation_options(o) -> None:
    """--activation-quant / --smoothquant-alpha of a build (QuantOptions); ValueError names the flag."""
    check_activation_value(o.activation_quant)
    if o.activation_quant == "int8" and not (o.quantization == "int8" or o.quantization.startswith("int4")):
        raise ValueError(f"--activation-quant int8 runs int8 / int4 weights on integer dot products: it needs "
                         f"--quantization int8, int4-rtn, int4-awq or int4-gptq, got {o.quantization}")
    a = o.smoothquant_alpha
    if a is not None and (not isinstance(a, (int, float)) or not 0.0 <= a <= 1.0):
        raise ValueError(f"--smoothquant-alpha must be in [0, 1], got {a!r}")


def smoothquant_applies(o, tokenizer=True) -> bool:
    """Whether an --activation-quant int8 build smooths: --no-smoothquant never, --smoothquant-alpha
    always; by default for int8 weights only, and only when the source has a tokenizer for the
    calibration text (a GGUF without a vocabulary gets W8A8 without smoothing). Groups of 4-bit
    weights along the input dimension take the migrated outliers badly: on SmolLM2 (2,047
    held-out tokens) W4A8 with alpha 0.5 lost 17.8% in perplexity where W4A8 without it lost 0.6%
    (docs/quantization.md)."""
    if resolve_activation_quant(o.activation_quant, o.quantization) != "int8" or o.smoothquant is False:
        return False
    if o.smoothquant or o.smoothquant_alpha is not None:
        return True
    return o.quantization == "int8" and tokenizer is not None


def smoothquant_off(o, tokenizer=True) -> str:
    """Why an int8-activation build did not smooth (the build report's `smoothquant`)."""
    if o.smoothquant is False:
        return "off (--no-smoothquant)"
    if o.quantization != "int8":
        return "off (int4 weights: docs/quantization.md#integer-dot-activations-w8a8--w4a8)"
    return "off (the source has no tokenizer for the calibration text)" if tokenizer is None else "off"


def smooth_engine_tensors(cfg, tensors: Dict[str, torch.Tensor], runner, plan: dict, alpha: float,
                          progress=None) -> Tuple[Dict[str, torch.Tensor], dict]:
    """SmoothQuant over every layer: runner is a calibration.LayerwiseRunner over the float model
    of `tensors`, or a function returning (runner, calibration provenance) (the build's
    calibration set); the linears smoothed are those `plan` quantizes to int8 or int4. Returns
    (new tensors, report)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"--smoothquant-alpha must be in [0, 1], got {alpha}")
    info = None
    if callable(runner):
        runner, info = runner()
    new = dict(tensors)
    layers: dict = {}
    for i in range(cfg.model.num_layers):
        pre = f"layers.{i}."
        targets = {lin for lin in LINEARS if getattr(plan.get(pre + lin), "method", None) in ("int8", "int4")}
        layer = runner.model.layers[i]
        amax: Dict[str, torch.Tensor] = {}

        def on_input(name, x):
            a = x.abs().amax(0)
            amax[name] = a if name not in amax else torch.maximum(amax[name], a)
        mods = {lin: getattr(layer, lin) for lin in LINEARS if isinstance(getattr(layer, lin, None), torch.nn.Module)}
        handles = calib.capture_inputs(mods, on_input)
        try:
            runner.run_layer(i, advance=i < cfg.model.num_layers - 1)  # the float layer: exact either way
        finally:
            for h in handles:
                h.remove()
        layers.update(smooth_layer(cfg, i, new, amax, alpha, targets))
        if progress is not None:
            progress.done(i)
    report = {"alpha": alpha, "linears": len(layers), "layers": layers}
    return new, report if info is None else {**report, "calibration": info}
