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

from .quant_layers import LINEARS

AUTO = "auto"  # --smoothquant-alpha auto: per linear, by the calibration error (smoothquant_search.py)
# The default: the paper's migration strength on every linear. On SmolLM2's budget mix (with the
# centred head, quant_head.centred_head) it gave the least worst-domain perplexity increase, the
# measure the int8 budget is set in; AUTO gave the least mean KL
# (docs/quantization.md#integer-dot-activations-w8a8--w4a8).
DEFAULT_ALPHA = 0.5


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


def linear_factors(cfg, lin: str, w: torch.Tensor, x_amax: torch.Tensor, alpha: float) -> torch.Tensor:
    """The factors s of one linear (w its float weight (N, K), x_amax its inputs' per-channel max
    |x|), one per channel of the producer they fold into: K of them, except o_proj's, one per
    (KV head, dim), the max over the query heads that share it."""
    if lin != "o_proj":
        return smoothing_factors(x_amax, w.abs().amax(0), alpha)
    m = cfg.model
    group = m.num_heads // m.num_kv_heads

    def pool(t):  # (Hq * D,) -> (Hkv * D,)
        return t.view(m.num_kv_heads, group, m.head_dim).amax(1).reshape(-1)
    return smoothing_factors(pool(x_amax), pool(w.abs().amax(0)), alpha)


def input_factors(cfg, lin: str, s: torch.Tensor) -> torch.Tensor:
    """linear_factors' s spread over the linear's K inputs (o_proj: each query head takes its KV
    head's factors)."""
    if lin != "o_proj":
        return s
    m = cfg.model
    group = m.num_heads // m.num_kv_heads
    return s.view(m.num_kv_heads, 1, m.head_dim).expand(m.num_kv_heads, group, m.head_dim).reshape(-1)


def smoothable(cfg, i: int, new: Dict[str, torch.Tensor], targets) -> Tuple[str, ...]:
    """Layer i's linears in `targets` whose input division folds exactly into a producer in `new`."""
    pre = f"layers.{i}."
    has = lambda name: pre + name in new  # noqa: E731
    producer = {"qkv_proj": has("input_norm.weight"), "gate_up_proj": has("post_attn_norm.weight"),
                "o_proj": has("qkv_proj.weight"), "down_proj": has("gate_up_proj.weight")}
    return tuple(lin for lin in LINEARS if lin in targets and has(lin + ".weight") and producer[lin])


def smooth_layer(cfg, i: int, new: Dict[str, torch.Tensor], x_amax: Dict[str, torch.Tensor], alpha,
                 targets) -> Dict[str, dict]:
    """Fold SmoothQuant's factors for layer i's linears in `targets` into `new` (engine tensors,
    replaced not mutated). x_amax: each linear's per-input-channel max |x|; alpha: one strength for
    every linear, or {linear: strength or None (left as it is)}. Returns report entries."""
    m = cfg.model
    pre = f"layers.{i}."
    nq, nkv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    report = {}
    for lin in smoothable(cfg, i, new, targets):
        a = alpha.get(lin) if isinstance(alpha, dict) else alpha
        if a is None or lin not in x_amax:
            continue
        name = pre + lin + ".weight"
        s = linear_factors(cfg, lin, new[name].float(), x_amax[lin], a)
        new[name] = (new[name].float() * input_factors(cfg, lin, s)).to(new[name].dtype)
        if lin == "o_proj":
            rows, producer = slice(nq + nkv, nq + 2 * nkv), "qkv_proj"
        elif lin == "down_proj":
            rows, producer = slice(m.intermediate_size, None), "gate_up_proj"
        else:
            norm = pre + ("input_norm.weight" if lin == "qkv_proj" else "post_attn_norm.weight")
            new[norm] = (new[norm].float() / s).to(new[norm].dtype)
            producer = None
        if producer is not None:
            _scale_rows(new, pre + producer + ".weight", rows, s)
            if pre + producer + ".bias" in new:
                _scale_rows(new, pre + producer + ".bias", rows, s)
        report[pre + lin] = {"smoothquant_alpha": a, "smoothquant_factor_range": [float(s.min()), float(s.max())]}
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
    if a is not None and a != AUTO and (isinstance(a, bool) or not isinstance(a, (int, float)) or not 0.0 <= a <= 1.0):
        raise ValueError(f"--smoothquant-alpha must be a number in [0, 1] or {AUTO}, got {a!r}")


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
