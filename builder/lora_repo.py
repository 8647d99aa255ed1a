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

from tritium.backend.lora.adapter import DEFAULT_MAX_LORA_RANK, parse_lora_spec
from tritium.backend.lora.manager import DEFAULT_MAX_LORAS
from tritium.backend.lora.peft_folder import CONFIG_FILE, check_config, read_config


def add_lora_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("LoRA adapters of the served model in --repo (docs/lora.md)")
    g.add_argument("--lora", action="append", default=[], metavar="NAME=PATH",
                   help="a PEFT LoRA folder (adapter_config.json + adapter_model.safetensors) served as NAME "
                        "(repeatable); requests pick it by name")
    g.add_argument("--max-loras", type=int, default=None, metavar="N",
                   help=f"adapters held in device memory, and at most in one step (default {DEFAULT_MAX_LORAS})")
    g.add_argument("--max-lora-rank", type=int, default=None, metavar="R",
                   help=f"largest adapter rank per module the served model takes (default {DEFAULT_MAX_LORA_RANK})")


def _adapters(args) -> dict:
    out = {}
    for spec in getattr(args, "lora", []) or []:
        name, path = parse_lora_spec(spec)
        if name in out:
            raise ValueError(f"--lora: adapter {name!r} is given twice")
        if "," in path:
            raise ValueError(f"--lora {name}: the path must not contain ',' (lora_adapters separates entries with it)")
        out[name] = path if path.startswith("~") else os.path.abspath(path)
    return out


def lora_params(args) -> dict:
    """--lora / --max-loras / --max-lora-rank -> config.pbtxt parameters; each folder checked now."""
    adapters = _adapters(args)
    limits = {k: getattr(args, k, None) for k in ("max_loras", "max_lora_rank")}
    if not adapters:
        if any(v is not None for v in limits.values()):
            raise ValueError("--max-loras and --max-lora-rank need --lora NAME=PATH")
        return {}
    if not getattr(args, "repo", None):
        raise ValueError("--lora configures the served model: it needs --repo")
    for k, v in limits.items():
        if v is not None and v < 1:
            raise ValueError(f"--{k.replace('_', '-')} must be >= 1, got {v}")
    for name, path in adapters.items():
        who = f"LoRA adapter {name!r}"
        check_config(who, read_config(who, os.path.expanduser(path)))
        if not os.path.isfile(os.path.join(os.path.expanduser(path), "adapter_model.safetensors")):
            raise ValueError(f"{who}: {path} has no adapter_model.safetensors next to its {CONFIG_FILE} "
                             f"(Tritium reads safetensors only)")
    out = {"lora_adapters": ",".join(f"{n}={p}" for n, p in adapters.items())}
    out.update({k: str(v) for k, v in limits.items() if v is not None})
    return out


def check_lora_after_build(args, cfg) -> None:
    """Every --lora adapter against the built engine (layers, shapes, modules, rank)."""
    from tritium.backend.lora.peft_folder import load_peft_adapter
    rank = getattr(args, "max_lora_rank", None) or DEFAULT_MAX_LORA_RANK
    for name, path in _adapters(args).items():
        load_peft_adapter(name, path, cfg.model, rank)
