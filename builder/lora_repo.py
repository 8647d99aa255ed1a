"""`tritium build --repo ... --lora NAME=PATH`: the served model's LoRA adapters (docs/lora.md).

The adapters stay in their own folders; the LLM model's config.pbtxt lists them in its
`lora_adapters` parameter ("name=path,name=path"), so adding one later means editing that line
(or rerunning with --repo) and reloading the model: no engine rebuild. Each adapter is checked
twice: its folder before the build starts, and its shapes and modules against the built engine
before the repository is written.
"""
from __future__ import annotations

import argparse
import os

from tritium.backend.engine_options import add_lora_arguments as _add_lora_arguments
from tritium.backend.engine_options import lora_adapters_from_args, options_from_args
from tritium.backend.lora.adapter import DEFAULT_MAX_LORA_RANK
from tritium.backend.lora.peft_folder import CONFIG_FILE, check_config, read_config

LIMITS = ("max_loras", "max_lora_rank")  # the LoRA limits `tritium build --repo` writes beside lora_adapters


def add_lora_arguments(p: argparse.ArgumentParser) -> None:
    _add_lora_arguments(p, LIMITS, "LoRA adapters of the served model in --repo (docs/lora.md)")


def _adapters(args) -> dict:
    return {n: p if p.startswith("~") else os.path.abspath(p) for n, p in lora_adapters_from_args(args).items()}


def lora_params(args) -> dict:
    """--lora / --max-loras / --max-lora-rank -> config.pbtxt parameters; each folder checked now."""
    adapters = _adapters(args)
    limits = options_from_args(args, LIMITS)  # range errors name the flag
    if not adapters:
        if limits:
            raise ValueError("--max-loras and --max-lora-rank need --lora NAME=PATH")
        return {}
    if not getattr(args, "repo", None):
        raise ValueError("--lora configures the served model: it needs --repo")
    for name, path in adapters.items():
        who = f"LoRA adapter {name!r}"
        check_config(who, read_config(who, os.path.expanduser(path)))
        if not os.path.isfile(os.path.join(os.path.expanduser(path), "adapter_model.safetensors")):
            raise ValueError(f"{who}: {path} has no adapter_model.safetensors next to its {CONFIG_FILE} "
                             f"(Tritium reads safetensors only)")
    out = {"lora_adapters": ",".join(f"{n}={p}" for n, p in adapters.items())}
    out.update({k: str(v) for k, v in limits.items()})
    return out


def check_lora_after_build(args, cfg) -> None:
    """Every --lora adapter against the built engine (layers, shapes, modules, rank)."""
    from tritium.backend.lora.peft_folder import load_peft_adapter
    rank = options_from_args(args, ("max_lora_rank",)).get("max_lora_rank", DEFAULT_MAX_LORA_RANK)
    for name, path in _adapters(args).items():
        load_peft_adapter(name, path, cfg.model, rank)
