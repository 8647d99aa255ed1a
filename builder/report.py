"""Build-report helpers: bytes per component, JSON writing."""
from __future__ import annotations

import json
from typing import Dict

import torch


def component_of(name: str) -> str:
    if name.startswith("embed_tokens"):
        return "embedding"
    if name.startswith(("lm_head", "head_")):
        return "lm_head"
    if "norm" in name:
        return "norms"
    if any(f".{p}." in name for p in ("qkv_proj", "o_proj", "q_proj", "q_a_proj", "q_b_proj", "kv_a_proj", "kv_b_proj")) \
            or name.endswith(("k_scale", "v_scale", "k_offset", "v_offset")):
        return "attention"
    if "gate_up_proj" in name or "down_proj" in name:
        return "mlp"
    return "other"


def component_bytes(tensors: Dict[str, torch.Tensor]) -> Dict[str, int]:
    """Bytes per component plus 'total'."""
    out: Dict[str, int] = {}
    for n, t in tensors.items():
        c = component_of(n)
        out[c] = out.get(c, 0) + t.numel() * t.element_size()
    out["total"] = sum(out.values())
    return out


def kv_cache_report(cfg) -> dict:
    """The paged KV cache's size per token (build_report.json's kv_cache): per layer and over all
    layers, in the cache dtype; under tensor parallelism per rank too (a rank caches its own KV
    heads; multi-head latent attention's latent is replicated on every rank)."""
    from tritium.backend.config_moe import kv_cache_token_values
    from tritium.backend.model_runner import kv_bytes_per_token, kv_cache_dtype
    from tritium.backend.parallel_layout import local_config
    m = cfg.model
    elem = torch.empty((), dtype=kv_cache_dtype(cfg)).element_size()
    values = kv_cache_token_values(m)
    out = {"layout": (f"latent: kv_lora_rank {m.kv_lora_rank} + qk_rope_head_dim {m.qk_rope_head_dim} values"
                      if m.kv_lora_rank else f"K and V: 2 x {m.num_kv_heads} KV heads x head_dim {m.head_dim} values"),
           "values_per_token_per_layer": values, "element_bytes": elem,
           "bytes_per_token_per_layer": values * elem, "bytes_per_token": values * elem * m.num_layers}
    if cfg.tensor_parallel_size > 1:
        out["bytes_per_token_per_rank"] = [kv_bytes_per_token(local_config(cfg, r))
                                           for r in range(cfg.tensor_parallel_size)]
    return out


def kv_cache_line(kv: dict) -> str:
    """The console line of kv_cache_report."""
    return (f"KV cache: {kv['bytes_per_token']} bytes per token ({kv['bytes_per_token_per_layer']} per layer; "
            f"{kv['layout']} of {kv['element_bytes']} bytes)")


def activation_line(report: dict) -> str:
    """The console line of a build's activations (build_report.json activation_quant and
    quantization_report.smoothquant); '' for a report without the field (older engines)."""
    mode = report.get("activation_quant")
    if mode is None:
        return ""
    if mode == "none":
        q = report.get("quantization", "none")
        if q == "int8" or q.startswith("int4"):
            return "activations: weight-only (W8A16 / W4A16 numerics; --activation-quant int8 for integer dot products)"
        return "activations: not quantized (weight-only)"
    qr = report.get("quantization_report") or {}
    kind = "W8A8" if qr.get("method", report.get("quantization")) == "int8" else "W4A8"
    sq = qr.get("smoothquant")
    if isinstance(sq, dict) and sq.get("alpha") == "auto":
        counts = sq.get("alpha_counts") or {}
        picked = ", ".join(f"{a} x{n}" for a, n in sorted(counts.items()) if a != "none")
        sq_text = (f"SmoothQuant alpha per linear by calibration error ({picked or 'none smoothed'}; "
                   f"{counts.get('none', 0)} left unsmoothed)")
    else:
        sq_text = (f"SmoothQuant alpha {sq['alpha']} on {sq['linears']} linears" if isinstance(sq, dict)
                   else f"SmoothQuant {sq or 'off'}")
    return (f"activations: int8 per row and block of 32, integer dot products on CPU ({kind}; GPUs run "
            f"weight-only); {sq_text}; engine option activation_quant=none gives the weight-only numerics")


def write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def quality_summary(report: dict) -> list:
    """Console lines for a quantized build's held-out scores against the float model (the build
    report's quantization_report.eval): one line per domain; [] when there are none."""
    q = (report.get("quantization_report") or {})
    ev = q.get("eval") or {}
    domains = ev.get("domains") or {}
    if not domains:
        return []
    lines = [f"quality vs the float model ({ev.get('tokens_per_domain')} held-out tokens per domain; "
             f"build_report.json has the rest):"]
    for name, d in domains.items():
        lines.append(f"  {name}: perplexity {d['perplexity']:.3f} vs {d['reference_perplexity']:.3f} "
                     f"({100 * d['perplexity_increase']:+.2f}%), mean KL {d['mean_kl']:.4f}, "
                     f"top-1 agreement {100 * d['top1_agreement']:.1f}%")
    seconds = q.get("quantize_seconds")
    if seconds is not None:
        lines.append(f"quantization took {seconds:.0f} s")
    return lines


# ---- bits per weight (build_report.json "size") ------------------------------------------------

_OVERHEAD_LEAVES = ("scales", "zeros", "g_idx", "input_scale", "k_scale", "v_scale", "k_offset", "v_offset")


def weights_of(name: str, t: torch.Tensor, int6: tuple = ()) -> int:
    """How many model weights engine tensor `name` stores: a packed int6 qweight of a module in
    `int6` (four codes in three bytes) 4/3 x numel, a packed int4 qweight (uint8, two codes
    per byte) 2 x numel, an int8 / fp8 qweight or a float tensor numel; quantization parameters
    (scales, zeros, g_idx, ...) and the centred head's float32 vectors none."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf.endswith(_OVERHEAD_LEAVES) or name.startswith("head_"):
        return 0
    if leaf.endswith("qweight") and name.rsplit(".", 1)[0] in int6:
        return t.numel() * 4 // 3
    if leaf.endswith("qweight"):
        return t.numel() * (2 if t.dtype == torch.uint8 else 1)
    return t.numel()


def weight_group(name: str, tied: bool) -> str:
    """The group a tensor's bytes are reported under: the layers' linear kind ('qkv_proj', ...),
    'embed_tokens', 'lm_head' (the centred head's vectors with the tied embedding), else 'other'
    (norms, KV-cache scales)."""
    parts = name.split(".")
    if name.startswith("layers.") and len(parts) >= 4 and parts[2] in _LINEARS:
        return parts[2]
    if name.startswith("layers.") and len(parts) >= 4 and parts[2] == "experts":
        return "experts"
    if name.startswith("embed_tokens") or (name.startswith("head_") and tied):
        return "embed_tokens"
    if name.startswith(("lm_head", "head_")):
        return "lm_head"
    return "other"


_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "router", "shared_expert", "shared_expert_gate")


def size_report(tensors: Dict[str, torch.Tensor], tied: bool, int6: tuple = ()) -> dict:
    """Bytes and bits per weight of every group and of the whole engine (the embedding and LM
    head counted), and the engine's bytes against a bfloat16 engine of the same weights (2 bytes
    per weight); `int6`: the modules stored in the int6 layout (their qweight packs 4 codes in 3 bytes)."""
    groups: Dict[str, list] = {}
    for n, t in tensors.items():
        g = groups.setdefault(weight_group(n, tied), [0, 0])
        g[0] += t.numel() * t.element_size()
        g[1] += weights_of(n, t, int6)
    total_bytes = sum(b for b, _ in groups.values())
    total_weights = sum(w for _, w in groups.values())
    return {
        "bytes": total_bytes,
        "weights": total_weights,
        "bits_per_weight": round(8 * total_bytes / max(total_weights, 1), 4),
        "bf16_bytes": 2 * total_weights,
        "vs_bf16": round(total_bytes / max(2 * total_weights, 1), 4),
        "groups": {g: {"bytes": b, "weights": w, "bits_per_weight": round(8 * b / w, 4) if w else None}
                   for g, (b, w) in sorted(groups.items())},
    }


def size_summary(report: dict) -> list:
    """Console line for a build's size (build_report.json "size"); [] when absent."""
    s = report.get("size")
    if not s:
        return []
    parts = ", ".join(f"{g} {v['bits_per_weight']:.2f}" for g, v in s["groups"].items()
                      if v.get("bits_per_weight") is not None and g != "other")
    return [f"size: {s['bits_per_weight']:.2f} bits per weight ({parts}); {s['bytes'] / 1e6:.1f} MB, "
            f"{s['vs_bf16']:.3f}x a bfloat16 engine's {s['bf16_bytes'] / 1e6:.1f} MB"]
