"""config.pbtxt parameters of LoRA serving (docs/lora.md) -> LoRAConfig.

    lora_adapters   "name=path,name2=path2": PEFT folders (absolute, or relative to the model folder)
    max_loras       adapters in device memory and in one step (default 4)
    max_cpu_loras   adapters cached in host memory (default max(max_loras, number of adapters))
    max_lora_rank   largest adapter rank per module (default 16)
    enable_lora     true: serve adapters sent with requests (lora_task_id) even without lora_adapters
"""
from __future__ import annotations

from typing import Optional

from tritium.backend.lora.adapter import DEFAULT_MAX_LORA_RANK
from tritium.backend.lora.manager import DEFAULT_MAX_LORAS, LoRAConfig, parse_adapter_list
from tritium.backend.triton_backend.contract import resolve_path


def _int(params: dict, name: str) -> Optional[int]:
    v = params.get(name, "").strip()
    if not v:
        return None
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"parameter {name} must be an integer, got {v!r}") from None


def lora_config_from_params(params: dict, model_dir: str) -> Optional[LoRAConfig]:
    """None when the model serves no adapters; ValueError naming the parameter otherwise."""
    adapters = {n: resolve_path(p, model_dir) for n, p in
                parse_adapter_list(params.get("lora_adapters", ""), "parameter lora_adapters").items()}
    enable = params.get("enable_lora", "").strip().lower()
    if enable not in ("", "true", "false", "1", "0"):
        raise ValueError(f"parameter enable_lora must be true or false, got {enable!r}")
    limits = {n: _int(params, n) for n in ("max_loras", "max_cpu_loras", "max_lora_rank")}
    if not adapters and enable not in ("true", "1"):
        return None
    return LoRAConfig(adapters, max_loras=limits["max_loras"] or DEFAULT_MAX_LORAS,
                      max_cpu_loras=limits["max_cpu_loras"],
                      max_lora_rank=limits["max_lora_rank"] or DEFAULT_MAX_LORA_RANK).validate()
