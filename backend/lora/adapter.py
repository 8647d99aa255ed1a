"""A LoRA adapter mapped onto the engine's linears, and the checks that it fits the engine.

LoRA (Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", 2021) adds to a linear
W x the delta scale * B (A x), A: (r, in), B: (out, r). Tritium fuses q/k/v into `qkv_proj` and
gate/up into `gate_up_proj`; the delta of a fused linear is the concatenation of its parts'
deltas, so its A stacks the parts' A rows and its B is block-diagonal (part p's B in its output
rows and its own rank columns; a part without an adapter contributes no rows). A checkpoint that
fuses them itself (Phi-3's `qkv_proj` / `gate_up_proj`, in the engine's row order) has PEFT
adapters on the fused linear: their A and B are the engine module's as they are. The scale is
folded into B once, at load.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

# Engine linear -> its parts in HF / PEFT module names, in the fused row order.
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
               "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
# Linears a checkpoint may hold already fused (Phi-3): an adapter on one is the engine module's.
WHOLE = ("qkv_proj", "gate_up_proj")
PART_TO_FUSED = {**{p: f for f, parts in FUSED_PARTS.items() for p in parts}, **{w: w for w in WHOLE}}
SUPPORTED_TARGETS = tuple(PART_TO_FUSED)
DEFAULT_MAX_LORA_RANK = 16  # as vLLM; max_lora_rank sizes the device slots


MLP_LINEARS = ("gate_up_proj", "down_proj")


def is_sparse(model_cfg, layer: int) -> bool:
    """Whether layer `layer`'s MLP is a mixture of experts (its experts take no adapter)."""
    return bool(getattr(model_cfg, "num_experts", 0)) and layer not in getattr(model_cfg, "dense_layers", ())


def adapted_linears(model_cfg, layer: int) -> List[str]:
    """The engine linears of a layer that take adapters: all four, or the attention's alone on a
    mixture-of-experts layer."""
    return [n for n in module_names() if not (n in MLP_LINEARS and is_sparse(model_cfg, layer))]


def part_shapes(model_cfg) -> Dict[str, Tuple[int, int]]:
    """(in_features, out_features) of every part, from the engine's ModelConfig."""
    m = model_cfg
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    return {"q_proj": (m.hidden_size, q), "k_proj": (m.hidden_size, kv), "v_proj": (m.hidden_size, kv),
            "o_proj": (q, m.hidden_size), "gate_proj": (m.hidden_size, m.intermediate_size),
            "up_proj": (m.hidden_size, m.intermediate_size), "down_proj": (m.intermediate_size, m.hidden_size),
            "qkv_proj": (m.hidden_size, q + 2 * kv), "gate_up_proj": (m.hidden_size, 2 * m.intermediate_size)}


@dataclass
class PartWeights:
    """One HF linear's adapter: A (r, in), B (out, r) and its scale (lora_alpha / r, or / sqrt(r))."""
    a: torch.Tensor
    b: torch.Tensor
    scale: float


@dataclass
class LoRAAdapter:
    """An adapter in the engine's layout, on the host (float32).

    modules[(layer, engine linear)] = (A (R, in), B (out, R)) with R the summed rank of the parts
    present; B carries the scale. `key` names it in caches ("name:sql" or "task:7"); `digest`
    identifies its weights (the prefix cache keys KV blocks by it).
    """
    key: str
    source: str                                   # where it came from (a path, or "request")
    modules: Dict[Tuple[int, str], Tuple[torch.Tensor, torch.Tensor]]
    max_rank: int                                 # the largest part rank
    digest: bytes = field(default=b"")
    num_bytes: int = 0

    def rank_of(self, layer: int, name: str) -> int:
        w = self.modules.get((layer, name))
        return 0 if w is None else w[0].shape[0]


def fuse(model_cfg, parts: Dict[Tuple[int, str], PartWeights]) -> Dict[Tuple[int, str], Tuple[torch.Tensor, torch.Tensor]]:
    """Per-part weights -> engine modules (block-diagonal B for the fused linears)."""
    shapes = part_shapes(model_cfg)
    out = {}
    for layer in sorted({lay for lay, _ in parts}):
        for fused, names in FUSED_PARTS.items():
            whole = parts.get((layer, fused)) if fused in WHOLE else None
            if whole is not None:  # already fused in the checkpoint (Phi-3)
                out[(layer, fused)] = (whole.a.float().clone(), whole.b.float() * whole.scale)
                continue
            present = [(n, parts[(layer, n)]) for n in names if (layer, n) in parts]
            if not present:
                continue
            k = shapes[names[0]][0]
            n_out = sum(shapes[n][1] for n in names)
            r_total = sum(p.a.shape[0] for _, p in present)
            a = torch.zeros(r_total, k, dtype=torch.float32)
            b = torch.zeros(n_out, r_total, dtype=torch.float32)
            r0 = 0
            for n, p in present:
                row0 = sum(shapes[m][1] for m in names[:names.index(n)])
                r = p.a.shape[0]
                a[r0:r0 + r] = p.a.float()
                b[row0:row0 + shapes[n][1], r0:r0 + r] = p.b.float() * p.scale
                r0 += r
            out[(layer, fused)] = (a, b)
    return out


def check_parts(who: str, model_cfg, parts: Dict[Tuple[int, str], PartWeights], max_lora_rank: int) -> None:
    """ValueError (naming the adapter) unless every part fits this engine's layers and shapes."""
    shapes = part_shapes(model_cfg)
    if not parts:
        raise ValueError(f"{who}: holds no LoRA weights for q/k/v/o/gate/up/down_proj")
    for (layer, name), p in sorted(parts.items()):
        if not 0 <= layer < model_cfg.num_layers:
            raise ValueError(f"{who}: has weights for layer {layer}, but the engine's model has "
                             f"{model_cfg.num_layers} layers (an adapter for another base model?)")
        if PART_TO_FUSED[name] in MLP_LINEARS and is_sparse(model_cfg, layer):
            raise ValueError(f"{who}: has weights for layers.{layer}.{name}, but layer {layer} is a mixture-of-experts "
                             f"layer: adapters on its experts are not supported (only the attention projections "
                             f"q/k/v/o, and the MLP of dense layers)")
        k, n = shapes[name]
        r = p.a.shape[0]
        if p.a.dim() != 2 or p.b.dim() != 2 or tuple(p.a.shape) != (r, k) or tuple(p.b.shape) != (n, r):
            raise ValueError(f"{who}: layers.{layer}.{name}: lora_A {tuple(p.a.shape)} / lora_B "
                             f"{tuple(p.b.shape)} do not fit the engine's {name} ({k} -> {n}; expected A ({r}, {k}), "
                             f"B ({n}, {r})): an adapter for another base model?")
        if not 1 <= r <= max_lora_rank:
            raise ValueError(f"{who}: layers.{layer}.{name} has rank {r}; this engine takes ranks 1..{max_lora_rank} "
                             f"(raise max_lora_rank)")
        if not (torch.isfinite(p.a).all() and torch.isfinite(p.b).all()):
            raise ValueError(f"{who}: layers.{layer}.{name} holds NaN or infinite weights")
        if name in WHOLE:
            both = [n for n in FUSED_PARTS[name] if (layer, n) in parts]
            if both:
                raise ValueError(f"{who}: layers.{layer} has weights for {name} and for its parts {both}; "
                                 f"give one or the other")


def make_adapter(key: str, source: str, model_cfg, parts: Dict[Tuple[int, str], PartWeights],
                 max_lora_rank: int) -> LoRAAdapter:
    """Check the parts against the engine, fuse them, and fingerprint the result."""
    check_parts(f"LoRA adapter {key!r}", model_cfg, parts, max_lora_rank)
    h = hashlib.sha256()  # over the parts as given (SHA extensions make it the fast one here)
    for (layer, name), p in sorted(parts.items()):
        h.update(f"{layer}.{name}:{p.scale!r}".encode())
        for t in (p.a, p.b):
            h.update(t.detach().float().contiguous().numpy())
    modules = fuse(model_cfg, parts)
    nbytes = sum(t.numel() * t.element_size() for a, b in modules.values() for t in (a, b))
    return LoRAAdapter(key, source, modules, max(p.a.shape[0] for p in parts.values()), h.digest()[:16], nbytes)


def module_names() -> List[str]:
    return list(FUSED_PARTS)


def fused_rank_capacity(name: str, max_lora_rank: int) -> int:
    """Largest summed rank a fused engine linear can hold (every part at max_lora_rank)."""
    return len(FUSED_PARTS[name]) * max_lora_rank


def parse_lora_spec(spec: str, option: str = "--lora") -> Tuple[str, str]:
    """'NAME=PATH' -> (name, path); names are letters, digits, '-', '_', '.' (they become model ids)."""
    name, sep, path = spec.partition("=")
    name, path = name.strip(), path.strip()
    if not sep or not name or not path:
        raise ValueError(f"{option} must be NAME=PATH, got {spec!r}")
    check_name(name, option)
    return name, path


def check_name(name: str, what: str = "adapter name") -> None:
    if not isinstance(name, str) or not name or not all(c.isalnum() or c in "-_." for c in name):
        raise ValueError(f"{what}: adapter names are letters, digits, '-', '_' or '.', got {name!r}")


def optional_int(v: Optional[int], name: str, lo: int) -> Optional[int]:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
    return v
