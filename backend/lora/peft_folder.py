"""Read a Hugging Face PEFT LoRA folder (adapter_config.json + adapter_model.safetensors).

Only safetensors: a pickled `adapter_model.bin` is refused (unpickling runs code). What PEFT
writes for plain LoRA on q/k/v/o/gate/up/down_proj is taken as is, any rank per module
(`rank_pattern`), `lora_alpha` with `alpha_pattern`, and rsLoRA scaling (`use_rslora`: alpha /
sqrt(r), Kalajdzievski 2023, instead of alpha / r). What would change the maths in ways the
engine does not apply (DoRA, LoRA biases, trained base biases, replaced modules, embedding
LoRA) is refused with the reason, never silently dropped.
"""
from __future__ import annotations

import json
import math
import os
import re
from typing import Dict, Tuple

from .adapter import SUPPORTED_TARGETS, LoRAAdapter, PartWeights, make_adapter

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_ALL_LINEAR = "all-linear"
# PEFT's names for LoRA on a mixture-of-experts block (transformers' fused experts, targeted as
# parameters or modules; Mixtral's block_sparse_moe; Qwen2-MoE's shared expert; the router)
_MOE_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:mlp|block_sparse_moe)\."
                      r"(experts|shared_expert_gate|shared_expert|gate)\b")
_MOE_PART = {"experts": "experts", "shared_expert": "shared expert", "shared_expert_gate": "shared expert's gate",
             "gate": "router"}


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: a key matches a module name ending in it."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def read_config(who: str, path: str) -> dict:
    cfg_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path):
        raise ValueError(f"{who}: {path} is not a folder (a PEFT adapter is a folder with {CONFIG_FILE} "
                         f"and {WEIGHTS_FILE})")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"{who}: {cfg_path} is missing")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{who}: {cfg_path} is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{who}: {cfg_path} must hold a JSON object")
    return cfg


def check_config(who: str, cfg: dict) -> None:
    """Refuse what the engine cannot apply exactly; the message names the field."""
    peft_type = cfg.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise ValueError(f"{who}: peft_type {peft_type!r} is not supported; only LORA adapters")
    refuse = {"use_dora": "DoRA (use_dora) is not supported", "lora_bias": "LoRA biases (lora_bias) are not supported",
              "fan_in_fan_out": "fan_in_fan_out (Conv1D bases such as GPT-2) is not supported"}
    for key, why in refuse.items():
        if cfg.get(key):
            raise ValueError(f"{who}: {why}")
    if cfg.get("bias", "none") not in ("none", None):
        raise ValueError(f"{who}: bias {cfg['bias']!r} trains the base model's biases; only bias 'none' is supported")
    if cfg.get("modules_to_save"):
        raise ValueError(f"{who}: modules_to_save {cfg['modules_to_save']} replaces whole base modules; not supported")
    if cfg.get("trainable_token_indices"):
        raise ValueError(f"{who}: trainable_token_indices (new token embeddings) is not supported")
    if cfg.get("target_parameters"):
        raise ValueError(f"{who}: target_parameters {cfg['target_parameters']}: LoRA on raw parameters (how PEFT "
                         f"adapts the experts and routers of mixture-of-experts layers) is not supported; adapters "
                         f"on experts are not supported (target the attention projections q/k/v/o)")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        bad = [t for t in targets if t.split(".")[-1] not in SUPPORTED_TARGETS]
        if bad:
            raise ValueError(f"{who}: target_modules {bad} cannot take LoRA in this engine; supported: "
                             f"{', '.join(SUPPORTED_TARGETS)}")
    for key in ("r", "lora_alpha"):
        v = cfg.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0):
            raise ValueError(f"{who}: {key} must be a positive number, got {v!r}")


def load_peft_adapter(key: str, path: str, model_cfg, max_lora_rank: int) -> LoRAAdapter:
    """Read, check and map a PEFT LoRA folder onto the engine (ValueError naming `key` and the reason)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    path = os.path.expanduser(path)
    who = f"LoRA adapter {key!r}"
    cfg = read_config(who, path)
    check_config(who, cfg)
    wpath = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(wpath):
        pickled = [f for f in ("adapter_model.bin", "adapter_model.pt") if os.path.isfile(os.path.join(path, f))]
        if pickled:
            raise ValueError(f"{who}: {path} holds only {pickled[0]}, a pickle; Tritium never unpickles "
                             f"(it can run code). Save the adapter as safetensors: PeftModel.save_pretrained("
                             f"dir, safe_serialization=True)")
        raise ValueError(f"{who}: {wpath} is missing")
    try:
        tensors = load_file(wpath, device="cpu")
    except (SafetensorError, OSError, RuntimeError) as e:
        raise ValueError(f"{who}: cannot read {wpath} ({e})") from None
    alpha = float(cfg.get("lora_alpha", cfg.get("r", 8)))
    rslora = bool(cfg.get("use_rslora", False))
    found: Dict[Tuple[int, str], Dict[str, object]] = {}
    for name, t in tensors.items():
        m = _KEY.match(name)
        moe = _MOE_KEY.match(name)
        if moe is not None:
            raise ValueError(f"{who}: tensor {name!r} adapts the {_MOE_PART[moe.group(2)]} of mixture-of-experts layer "
                             f"{moe.group(1)}; adapters on experts and routers are not supported (only the attention "
                             f"projections q/k/v/o, and the MLP of dense layers)")
        if m is None:
            raise ValueError(f"{who}: tensor {name!r} is not a LoRA A/B weight of a q/k/v/o/gate/up/down_proj "
                             f"linear; this engine cannot apply it")
        layer, block, part, ab = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if part not in SUPPORTED_TARGETS:
            raise ValueError(f"{who}: tensor {name!r} targets {part!r}; supported modules: {', '.join(SUPPORTED_TARGETS)}")
        entry = found.setdefault((layer, part), {"module": f"model.layers.{layer}.{block}.{part}"})
        entry[ab] = t
    parts: Dict[Tuple[int, str], PartWeights] = {}
    for (layer, part), e in found.items():
        if "A" not in e or "B" not in e:
            raise ValueError(f"{who}: layers.{layer}.{part} has lora_{'A' if 'A' not in e else 'B'} missing")
        r = e["A"].shape[0]
        a_ = float(_pattern_value(cfg.get("alpha_pattern") or {}, e["module"], alpha))
        scale = a_ / math.sqrt(r) if rslora else a_ / r
        parts[(layer, part)] = PartWeights(e["A"], e["B"], scale)
    return make_adapter(key, path, model_cfg, parts, max_lora_rank)
