"""int4 builds: the embedding and LM head as per-row symmetric int8, quantized by the build's own
method where calibration exists.

The LM head is a linear like any other: its input is the final RMSNorm's output, so the
calibrated methods treat it as they treat the layers' linears, on quantize_int8's grid
(one scale per vocabulary row, the layout the runtime's int8 GEMM reads):
- int4-rtn: round to nearest (amax / 127 per row), the baseline;
- int4-gptq: GPTQ error feedback under the Hessian of the final hidden states (gptq_rows.py);
- int4-awq: AWQ's per-channel scales s = mean|x|^alpha, alpha grid-searched for the least
  logits error, folded into the final norm (norm.weight / s) with the head stored as W * s; then
  AWQ's clip search: each row's clip range (a ratio of its amax) chosen for the least output
  error; and the head is centred (below).
A tied embedding is the same matrix: its lookup reads the same int8 rows, and after AWQ divides
them by s again (`embed_tokens.input_scale`, the one extra vector this costs). An untied
embedding has no activation input and always takes round-to-nearest.

Centring (bias correction, Nagel et al., "Data-Free Quantization Through Weight Equalization and
Bias Correction", 2019, in its empirical form with the mean taken from calibration data): the
head's input has a large mean mu (a few channels are big and nearly constant), so the rounding
error D = Q/s - W shifts each vocabulary row's logit by about D mu for every token, a per-token-
type bias that no per-channel scale removes; and the packed CPU GEMM rounds its input and its
output to bfloat16, which on logits dominated by that mean costs more than the int8 rounding.
int4-awq therefore computes the logits as ((x - mu) / s) Q^T + mu W^T: the GEMM sees only the
centred input, and the mean's logits mu W^T are computed once, in float32, from the unquantized
weights (engine tensors `head_input_mean` = mu / s, (hidden,), and `head_mean_logits`, (vocab,),
both float32). It is the same function as x W^T up to the rounding of the centred part, so
AWQ's two searches minimise that part's output error: on x - mu, i.e. tr(D C D^T) with C the
inputs' covariance. GPTQ's error feedback under the uncentred Hessian already drives D mu to
about zero, and its head is left uncentred.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from tritium.kernels import ops
from tritium.kernels.quant_layouts import dequantize_grouped, dequantize_int4, pack_int6

from .awq import awq_clip_int4, awq_clip_rows_int8, awq_search_scale, fake_quantize_int8_rows
from .gptq import HessianAccumulator, gptq_quantize
from .gptq_rows import gptq_int6_grouped, gptq_int8_quantize
from .param16 import compact_scales
from .quantize_int4 import quantize_int4
from .quantize_int8 import (dequantize_int8, int8_codes, int8_row_scales, int6_scales, quantize_int6, quantize_int8,
                            quantize_int8_grouped)

HEAD_SEARCH_TOKENS = 512  # calibration rows used in AWQ's alpha search on the head
CENTRED_BY_DEFAULT = {"int4-awq": True}  # methods whose int8 head is centred unless told otherwise


def head_name(plan: dict, tied: bool) -> Optional[str]:
    """The plan entry that serves as the LM head ('embed_tokens' when tied), if it is quantized
    (int8, or int6 / int4 with --embedding-quantization)."""
    name = "embed_tokens" if tied else "lm_head"
    lq = plan.get(name)
    return name if lq is not None and lq.method in ("int8", "int6", "int4") else None


def centred_head(o, tokenizer) -> Optional[bool]:
    """Whether a build (QuantOptions o) centres its LM head. --quantization int8 with int8
    activations does by default where a tokenizer gives the calibration text's mean: the final
    hidden states' few large, nearly constant channels would otherwise set the step of their
    blocks of 32 when the head quantizes its input to int8 (on the budget mix, docs/quantization.md,
    centring cut the W8A8 engine's mean KL by 15-26%). None: quantize_embeddings'
    default (CENTRED_BY_DEFAULT)."""
    if o.head_centring is not None or o.quantization != "int8" or o.activation_quant != "int8":
        return o.head_centring
    return tokenizer is not None


@torch.no_grad()
def collect_head_stats(runner) -> dict:
    """Final-norm outputs of the calibration set (the LM head's inputs), from a LayerwiseRunner
    that has advanced through every layer: their Hessian H = 2/n sum x x^T (GPTQ), mean, mean |x|
    and a strided subsample of rows (AWQ's searches)."""
    model = runner.model
    eps = model.cfg.model.rms_norm_eps
    acc = HessianAccumulator(model.cfg.model.hidden_size)
    abs_sum, x_sum, count, rows = 0, 0, 0, []
    stride = max(1, runner.num_tokens // HEAD_SEARCH_TOKENS)
    for h, r in zip(runner.hidden, runner.residual):
        x, _ = ops.rms_norm(h, model.norm_weight, eps, r)
        x = x.float()
        acc.add(x)
        abs_sum = abs_sum + x.abs().sum(0)
        x_sum = x_sum + x.sum(0)
        count += x.shape[0]
        rows.append(x[::stride])
    return {"mean_abs": abs_sum / count, "mean": x_sum / count,
            "x": torch.cat(rows)[:HEAD_SEARCH_TOKENS], "H": acc.hessian()}


def centred_hessian(stats: dict) -> torch.Tensor:
    """C = 2/n sum (x - mu)(x - mu)^T = H - 2 mu mu^T, from collect_head_stats' H (2/n sum x x^T)
    and mean: the output error tr(D C D^T) is what a bias-corrected head is left with."""
    mu = stats["mean"].float()
    return stats["H"].float() - 2.0 * torch.outer(mu, mu)


def quantize_embeddings(new: dict, plan: dict, method: str, tied: bool,
                        head_stats: Optional[dict] = None, centre: Optional[bool] = None) -> dict:
    """Replace `{name}.weight` of the int8 embedding / LM head in `new` by qweight/scales. For an
    AWQ head: fold its scales into norm.weight and, when tied, add embed_tokens.input_scale and
    mark plan['embed_tokens'].input_scale. A centred head (centre; None: CENTRED_BY_DEFAULT[method])
    gets head_input_mean / head_mean_logits from head_stats' mean and its plan entry marked
    centred. Returns report entries."""
    report = {}
    head = head_name(plan, tied)
    if centre is None:  # the int6 head is not centred by default: its float32 mean logits (4 bytes
        # per vocabulary row) would take an int4 engine past 0.33x the bfloat16 one (docs/quantization.md)
        centre = CENTRED_BY_DEFAULT.get(method, False) and head is not None and plan[head].method == "int8"
    for name in ("embed_tokens", "lm_head"):
        lq = plan.get(name)
        if lq is not None and lq.method == "int4" and name + ".weight" in new:
            report[name] = _int4_embedding(new, name, lq, method, head_stats if name == head else None)
            report[name]["head"] = name == head
            continue
        if lq is None or lq.method not in ("int8", "int6") or name + ".weight" not in new:
            continue
        w = new.pop(name + ".weight").float()
        six = lq.method == "int6"
        qmax = 31 if six else 127  # GPTQ's code range: int6 -32..31 (scales from int6_scales), int8 -127..127
        entry = {"method": lq.method, "head": name == head}
        # the calibrated roundings below are per-row (int6: GPTQ also with groups): a grouped int8
        # embedding is rounded to nearest
        # centring needs only the statistics' mean and works on any rounding
        stats = head_stats if name == head and (six or not lq.group_size or centre) else None
        # what is quantized (W, or W * s after AWQ's scales), and the Hessian of the inputs it sees
        wq, h_in = w, (stats["H"] if stats is not None else None)
        if stats is not None and method == "int4-gptq" and not lq.group_size:
            q, s = gptq_int8_quantize(w, stats["H"], qmax=qmax, scales=int6_scales(w) if six else None)
            entry["rounding"] = "GPTQ error feedback (act-order) under the final hidden states' Hessian"
        elif stats is not None and method == "int4-awq" and not six and not lq.group_size:
            mu = stats["mean"].float() if centre else torch.zeros_like(stats["mean"].float())
            # a centred head: only x - mu meets the rounding, so both searches score that part
            h_in = centred_hessian(stats) if centre else stats["H"]
            scale, alpha, _ = awq_search_scale([w], stats["x"] - mu, stats["mean_abs"], None,
                                               fake_quant=fake_quantize_int8_rows)
            entry["awq_alpha"] = alpha
            entry["rounding"] = ("AWQ scales folded into norm.weight, then AWQ's per-row clip search"
                                 + (", both on mean-centred inputs; the GEMM sees x - mean and the mean's "
                                    "logits are added in float32" if centre else ""))
            if bool((scale != 1).any()):
                wq = w * scale
                h_in = h_in / scale[:, None] / scale[None, :]  # the covariance of x / s
                norm = new["norm.weight"]
                new["norm.weight"] = (norm.float() / scale).to(norm.dtype)
                if tied:
                    new["embed_tokens.input_scale"] = scale.float()
                    plan[name] = dataclasses.replace(plan[name], input_scale=True)
            s = awq_clip_rows_int8(wq, h_in)
            q = int8_codes(wq, s).to(torch.int8)
            entry["clipped_rows"] = int((s < int8_row_scales(wq) * 0.9999).sum())
            in_scale = scale
        elif lq.group_size and six and stats is not None and method == "int4-gptq":
            q, s = gptq_int6_grouped(w, stats["H"], lq.group_size, int6_scales(w, lq.group_size))
            entry["rounding"] = (f"GPTQ error feedback (act-order, static groups of {lq.group_size}) "
                                 "under the final hidden states' Hessian")
        elif lq.group_size and not six:
            q, s = quantize_int8_grouped(w, lq.group_size)
            entry["rounding"] = (f"round to nearest, symmetric groups of {lq.group_size} "
                                 f"({lq.group_reason or 'float16 scales'})")
        elif six:
            q, s = quantize_int6(w, lq.group_size)
            entry["rounding"] = ("round to nearest, scales by a clip search for the least weight error"
                                 + (" (AWQ's searches are int8-only)" if stats is not None else ""))
        else:
            q, s = quantize_int8(w)
            entry["rounding"] = "round to nearest"
        if stats is not None and centre:
            if method != "int4-awq" or six:  # the rounding is the method's own; centring adds the bias term
                in_scale, h_in = torch.ones_like(stats["mean"].float()), centred_hessian(stats)
            new["head_input_mean"] = stats["mean"].float() / in_scale
            new["head_mean_logits"] = w @ stats["mean"].float()
            plan[name] = dataclasses.replace(plan[name], centred=True)
        new[name + ".qweight"], new[name + ".scales"] = (pack_int6(q) if six else q), compact_scales(s)
        deq = dequantize_grouped(q, s, None, lq.group_size) if lq.group_size else dequantize_int8(q, s)
        entry["rel_weight_error"] = float((deq - wq).norm() / wq.norm().clamp_min(1e-12))
        if stats is not None:
            # the head's error on calibration inputs, ||X W^T - X' Q^T|| / ||X W^T||, where
            # X' = X / s is what an AWQ-scaled head sees (then H' = diag(1/s) H diag(1/s)); a
            # centred head's error is that of X - mu (h_in is then the covariance)
            d = deq - wq
            entry["rel_output_error"] = float(((d @ h_in) * d).sum() / ((w @ stats["H"]) * w).sum())
        if plan[name].centred:
            # what the centring corrects: an uncentred head's mean output error (Q/s - W) mu = d mu/s
            entry["bias_correction_rms"] = float((d @ new["head_input_mean"]).pow(2).mean().sqrt())
        report[name] = entry
    return report


def _int4_embedding(new: dict, name: str, lq, method: str, stats: Optional[dict]) -> dict:
    """--embedding-quantization int4: the embedding / LM head in the int4 layout (asymmetric
    groups, float16 scales and zeros); the lookup dequantizes gathered rows. The head is rounded
    by the build's method where its calibration statistics exist: int4-gptq with GPTQ under the
    final hidden states' Hessian (act-order column order, static groups: no g_idx), int4-awq
    with AWQ's per-(row, group) clip search under that Hessian; else to nearest."""
    w = new.pop(name + ".weight").float()
    g = lq.group_size
    if stats is not None and method == "int4-gptq":
        q, s, z, _ = gptq_quantize(w, stats["H"], g, act_order=True, static_groups=True)
        rounding = f"GPTQ error feedback (act-order, static groups of {g}) under the final hidden states' Hessian"
    elif stats is not None and method == "int4-awq":
        q, s, z = quantize_int4(w, g, awq_clip_int4(w, stats["H"], g))
        rounding = f"AWQ's clip search per (row, group of {g}) under the final hidden states' Hessian"
    else:
        q, s, z = quantize_int4(w, g)
        rounding = f"round to nearest, asymmetric groups of {g}"
    s, z = s.half(), z.half()
    new[name + ".qweight"], new[name + ".scales"], new[name + ".zeros"] = q, s, z
    deq = dequantize_int4(q, s, z, g)
    entry = {"method": "int4", "rounding": rounding,
             "rel_weight_error": float((deq - w).norm() / w.norm().clamp_min(1e-12))}
    if stats is not None:
        d = deq - w
        entry["rel_output_error"] = float(((d @ stats["H"]) * d).sum() / ((w @ stats["H"]) * w).sum())
    return entry
