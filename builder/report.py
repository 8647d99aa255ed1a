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
