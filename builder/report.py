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
    if "qkv_proj" in name or "o_proj" in name or name.endswith(("k_scale", "v_scale", "k_offset", "v_offset")):
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
