"""Quantize the four linears of one decoder layer in an engine state dict.

Replaces `layers.{i}.{linear}.weight` by the method's tensors (qweight, scales, zeros, g_idx),
folds AWQ scales into the preceding op's tensors, and puts the dequantized weights back into
the float calibration model so that later layers are calibrated on quantized inputs.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from tritium.kernels.quant_layouts import dequantize_int4

from .awq import awq_clip_int4, awq_search, awq_search_scale, group_weight_mean, pooled_head_stat
from .gptq import gptq_quantize
from tritium.kernels.quant_layouts import dequantize_grouped

from .gptq_fp8 import gptq_fp8_grouped, gptq_fp8_quantize
from .quantize_fp8 import dequantize_fp8, quantize_fp8, quantize_fp8_grouped
from .param16 import compact_scales
from .quantize_int4 import quantize_int4
from .quantize_int8 import dequantize_int8, quantize_int8, quantize_int8_grouped, quantize_int8_source_grid

LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def linear_in_features(m, lin: str) -> int:
    """Input dimension of a layer linear from the ModelConfig."""
    return {"qkv_proj": m.hidden_size, "gate_up_proj": m.hidden_size,
            "o_proj": m.num_heads * (m.v_head_dim if m.kv_lora_rank else m.head_dim),
            "down_proj": m.intermediate_size}[lin]


def quantize_weight(w: torch.Tensor, lq, method: str, stats: Optional[dict]):
    """One float weight (N, K) -> (engine tensors by suffix, dequantized float32 weight)."""
    if lq.method in ("int8", "fp8") and lq.group_size:
        return _quantize_grouped(w, lq, stats)
    if lq.method == "int8":
        q, s = quantize_int8(w)
        return {"qweight": q, "scales": compact_scales(s)}, dequantize_int8(q, s)
    if lq.method == "fp8":
        # GPTQ error feedback on the E4M3 grid when calibration Hessians exist (the pipeline's
        # default when the source has a tokenizer), else round-to-nearest.
        if stats and "H" in stats:
            q, s = gptq_fp8_quantize(w, stats["H"].hessian())
        else:
            q, s = quantize_fp8(w)
        return {"qweight": q, "scales": s}, dequantize_fp8(q, s)
    g_idx = None
    sym = lq.symmetric
    if method == "int4-gptq":
        q, s, z, g_idx = gptq_quantize(w, stats["H"].hessian(), lq.group_size,
                                       act_order=lq.act_order or lq.static_groups,
                                       static_groups=lq.static_groups, symmetric=sym)
    elif method == "int4-awq" and stats and "awq_H" in stats:
        params = awq_clip_int4(w, stats["awq_H"], lq.group_size, clip_rows=stats.get("clip_rows"), symmetric=sym)
        q, s, z = quantize_int4(w, lq.group_size, params)
    else:
        q, s, z = quantize_int4(w, lq.group_size, symmetric=sym)
    # Stored as float16 (half the bytes of float32; 11-bit mantissa, far finer than a 4-bit step).
    # The returned dequantized weight uses the stored values, so later layers calibrate on them.
    # Symmetric (Q4_0's grid): no zeros tensor at all.
    s, z = s.half(), (None if sym else z.half())
    out = {"qweight": q, "scales": s}
    if z is not None:
        out["zeros"] = z
    if g_idx is not None:
        out["g_idx"] = g_idx
    return out, dequantize_int4(q, s, z, lq.group_size, g_idx)


def _quantize_grouped(w: torch.Tensor, lq, stats: Optional[dict]):
    """Group-wise int8 / fp8 (symmetric, or asymmetric keeping a source grid): engine tensors and
    the dequantized float32 weight. fp8 uses GPTQ (static groups) when Hessians exist."""
    g, z = lq.group_size, None
    if lq.method == "int8" and lq.asymmetric:
        q, s, z = quantize_int8_source_grid(w, g)
    elif lq.method == "int8":
        q, s = quantize_int8_grouped(w, g)
    elif stats and "H" in stats:
        q, s, z = gptq_fp8_grouped(w, stats["H"].hessian(), g, lq.asymmetric)
    else:
        q, s, z = quantize_fp8_grouped(w, g, lq.asymmetric)
    out = {"qweight": q, "scales": s}
    if z is not None:
        out["zeros"] = z
    return out, dequantize_grouped(q, s, z, g)


def _awq_fold(cfg, i: int, W: Dict[str, torch.Tensor], new: dict, plan: dict, stats: dict) -> dict:
    """AWQ: search and fold the per-channel scales of the four linears of layer i.

    qkv <- input_norm, o_proj <- v rows of qkv (scale shared by query heads of a KV group),
    gate_up <- post_attn_norm, down <- up rows of gate_up. Mutates W and `new`; returns alphas.
    """
    m = cfg.model
    pre = f"layers.{i}."
    nq, nkv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    alphas = {}

    def search(lin, stat=None, pool=None):
        lq = plan.get(pre + lin)
        if lq is None or lq.method != "int4":
            return None
        st = stats[lin]
        if "H" not in st:  # no Hessian collected: the sampled-rows search of the paper's code
            s, alpha, _ = awq_search_scale([W[lin]], st["x"], st["mean_abs"] if stat is None else stat,
                                           lq.group_size, symmetric=lq.symmetric)
            alphas[lin] = alpha
            return s
        H = st["H"].hessian()
        w_mean = pool(group_weight_mean(W[lin], lq.group_size)) if pool else None
        choice = awq_search([W[lin]], H, st["mean_abs"] if stat is None else stat, lq.group_size,
                            w_mean=w_mean, symmetric=lq.symmetric)
        alphas[lin] = choice.alpha
        alphas[lin + ".duo"] = choice.duo
        # The clip search (quantize_weight) sees the scaled weight, so it needs H of the scaled
        # inputs x / s: H / (s s^T).
        st["awq_H"] = H / torch.outer(choice.scales, choice.scales)
        return choice.scales

    def fold_norm(norm_name, s):
        t = new[pre + norm_name]
        new[pre + norm_name] = (t.float() / s).to(t.dtype)

    # A scale on a linear's inputs folds into the norm that feeds it; OLMo 2's post-norm layers
    # have none before qkv_proj / gate_up_proj, so those two keep their unscaled weights.
    s = search("qkv_proj") if pre + "input_norm.weight" in new else None
    if s is not None:
        W["qkv_proj"] = W["qkv_proj"] * s
        fold_norm("input_norm.weight", s)
    def pool(t):  # o_proj's scales are shared by the query heads of a KV head (folded into v rows)
        return pooled_head_stat(t, m.num_heads, m.num_kv_heads, m.head_dim)
    if "qkv_proj" in stats and "H" in stats["qkv_proj"]:
        # AWQ's clipping skips q and k (the paper's code): their error acts through the softmax.
        stats["qkv_proj"]["clip_rows"] = torch.arange(nq + 2 * nkv) >= nq + nkv
    s = search("o_proj", pool(stats["o_proj"]["mean_abs"]), pool)
    if s is not None:
        group = m.num_heads // m.num_kv_heads
        s_kv = s.view(m.num_kv_heads, group, m.head_dim)[:, 0].reshape(-1)
        W["o_proj"] = W["o_proj"] * s
        W["qkv_proj"] = W["qkv_proj"].clone()
        W["qkv_proj"][nq + nkv:] /= s_kv[:, None]
        if pre + "qkv_proj.bias" in new:
            b = new[pre + "qkv_proj.bias"]
            bf = b.float().clone()
            bf[nq + nkv:] /= s_kv
            new[pre + "qkv_proj.bias"] = bf.to(b.dtype)
    s = search("gate_up_proj") if pre + "post_attn_norm.weight" in new else None
    if s is not None:
        W["gate_up_proj"] = W["gate_up_proj"] * s
        fold_norm("post_attn_norm.weight", s)
    s = search("down_proj")
    if s is not None:
        W["down_proj"] = W["down_proj"] * s
        W["gate_up_proj"] = W["gate_up_proj"].clone()
        W["gate_up_proj"][m.intermediate_size:] /= s[:, None]
        if pre + "gate_up_proj.bias" in new:  # mlp_bias: the up rows' bias scales with them
            b = new[pre + "gate_up_proj.bias"]
            bf = b.float().clone()
            bf[m.intermediate_size:] /= s
            new[pre + "gate_up_proj.bias"] = bf.to(b.dtype)
    return alphas


def quantize_layer(cfg, i: int, layer, new: dict, plan: dict, method: str,
                   stats: Optional[dict]) -> dict:
    """Quantize layer i's linears in `new` (engine tensors, replaced not mutated) and load the
    dequantized result into `layer` (a float DecoderLayer). Returns per-linear report entries."""
    pre = f"layers.{i}."
    # A sparse MoE layer has no dense gate_up_proj / down_proj (its experts stay float).
    lins = tuple(lin for lin in LINEARS if pre + lin + ".weight" in new)
    W = {lin: new[pre + lin + ".weight"].float() for lin in lins}
    orig = {lin: w for lin, w in W.items()}
    report = {}
    alphas = _awq_fold(cfg, i, W, new, plan, stats) if method == "int4-awq" else {}
    for lin in lins:
        name = pre + lin
        lq = plan.get(name)
        mod = getattr(layer, lin)
        dtype = mod.weight.dtype
        if lq is None or lq.method == "none":
            new[name + ".weight"] = W[lin].to(dtype)  # may carry folded AWQ scales
            mod._buffers["weight"] = new[name + ".weight"]
            continue
        tensors, deq = quantize_weight(W[lin], lq, method, stats.get(lin) if stats else None)
        del new[name + ".weight"]
        for suffix, t in tensors.items():
            new[f"{name}.{suffix}"] = t
        mod._buffers["weight"] = deq.to(dtype)
        entry = {"method": lq.method, "group_size": lq.group_size, "group_reason": lq.group_reason,
                 "rel_weight_error": float((deq - W[lin]).norm() / W[lin].norm().clamp_min(1e-12))}
        if method == "int4-gptq":
            entry["gptq_order"] = ("act-order, static groups" if lq.static_groups else
                                   "act-order, g_idx" if lq.act_order else "column order")
        if lin in alphas:
            entry["awq_alpha"] = alphas[lin]
        if lin + ".duo" in alphas:
            entry["awq_duo_scaling"] = alphas[lin + ".duo"]
        if stats and "H" in stats.get(lin, {}):
            H = stats[lin]["H"].hessian()
            d = deq - orig[lin]
            entry["rel_output_error"] = float(((d @ H) * d).sum() / ((orig[lin] @ H) * orig[lin]).sum())
        report[name] = entry
    for norm in ("input_norm.weight", "post_attn_norm.weight"):
        if pre + norm in new:
            layer._buffers[norm.replace(".weight", "_weight")] = new[pre + norm]
    for lin in ("qkv_proj", "gate_up_proj"):
        if pre + lin + ".bias" in new:
            getattr(layer, lin)._buffers["bias"] = new[pre + lin + ".bias"]
    return report
