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
