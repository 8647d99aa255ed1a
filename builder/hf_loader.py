"""Load a Hugging Face checkpoint folder: config.json, *.safetensors (sharded or not), tokenizer.

Pickled weights (*.bin, *.pt, *.pth) are refused unless allow_pickle is set, because
unpickling runs arbitrary code.
"""
from __future__ import annotations

import glob
import json
import os
from typing import Dict, List, Optional

import torch
from safetensors import SafetensorError, safe_open

from tritium.backend.config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeConfig

from .convert import CheckpointError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json", "generation_config.json")
PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth")


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: file not found")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}); truncated?") from None


def _req(cfg: dict, key: str, path: str):
    if key not in cfg or cfg[key] is None:
        raise CheckpointError(f"{path}: required field {key!r} is missing")
    return cfg[key]


def model_config_from_hf(cfg: dict, path: str = "config.json") -> ModelConfig:
    """Translate an HF config.json dict into a ModelConfig (errors name the field)."""
    arch = cfg.get("model_type")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(f"{path}: model_type {arch!r} is not supported; supported: "
                              f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    hidden = int(_req(cfg, "hidden_size", path))
    heads = int(_req(cfg, "num_attention_heads", path))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    layers = int(_req(cfg, "num_hidden_layers", path))
    # transformers >= 5 nests rope settings in rope_parameters; older files use rope_theta/rope_scaling.
    rp = dict(cfg.get("rope_parameters") or {})
    rs = dict(cfg.get("rope_scaling") or {})
    rp = {**rs, **rp}
    theta = float(rp.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rtype = rp.get("rope_type", rp.get("type", "default")) or "default"
    if rtype not in ("default", "linear", "llama3"):
        raise CheckpointError(f"{path}: rope type {rtype!r} not supported; supported: default, linear, llama3")
    rope = RopeConfig(theta=theta, scaling_type=rtype, factor=float(rp.get("factor", 1.0)),
                      low_freq_factor=float(rp.get("low_freq_factor", 1.0)),
                      high_freq_factor=float(rp.get("high_freq_factor", 4.0)),
                      original_max_position_embeddings=rp.get("original_max_position_embeddings"))
    windows: tuple = ()
    sw = cfg.get("sliding_window")
    if cfg.get("layer_types"):
        lt = cfg["layer_types"]
        if len(lt) != layers:
            raise CheckpointError(f"{path}: layer_types has {len(lt)} entries, num_hidden_layers is {layers}")
        windows = tuple(int(sw) if (t == "sliding_attention" and sw) else None for t in lt)
    elif arch == "mistral" and sw:
        windows = (int(sw),) * layers
    elif arch == "qwen2" and sw and cfg.get("use_sliding_window"):
        mwl = int(cfg.get("max_window_layers", layers))
        windows = tuple(int(sw) if i >= mwl else None for i in range(layers))
    if windows and all(w is None for w in windows):
        windows = ()
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    return ModelConfig(
        architecture=arch, vocab_size=int(_req(cfg, "vocab_size", path)), hidden_size=hidden,
        intermediate_size=int(_req(cfg, "intermediate_size", path)), num_layers=layers,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)), rope=rope,
        attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        sliding_windows=windows, bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids,
        pad_token_id=cfg.get("pad_token_id"))


class HFCheckpoint:
    """Lazy reader over a checkpoint folder's safetensors shards."""

    def __init__(self, path: str, allow_pickle: bool = False):
        if not os.path.isdir(path):
            raise CheckpointError(f"{path}: checkpoint folder not found")
        self.path = path
        self.raw_config = _read_json(os.path.join(path, "config.json"))
        self.model_config = model_config_from_hf(self.raw_config, os.path.join(path, "config.json"))
        self._where: Dict[str, str] = {}
        self._pickled: Optional[Dict[str, torch.Tensor]] = None
        index = os.path.join(path, "model.safetensors.index.json")
        shards: List[str] = []
        if os.path.isfile(index):
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: field 'weight_map' missing")
            for name, shard in weight_map.items():
                self._where[name] = os.path.join(path, shard)
            shards = sorted(set(self._where.values()))
            for s in shards:
                if not os.path.isfile(s):
                    raise CheckpointError(f"{s}: shard listed in {os.path.basename(index)} not found")
        else:
            shards = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not shards:
            pickled = [f for pat in PICKLE_PATTERNS for f in glob.glob(os.path.join(path, pat))]
            if not pickled:
                raise CheckpointError(f"{path}: no *.safetensors weights found")
            if not allow_pickle:
                raise CheckpointError(
                    f"{path}: only pickled weights ({os.path.basename(pickled[0])}) found; unpickling can run "
                    f"arbitrary code, so it is refused. Convert to safetensors, or pass --allow-pickle if you trust the file")
            self._pickled = {}
            for f in pickled:
                self._pickled.update(torch.load(f, map_location="cpu", weights_only=True))
            return
        self._handles = {}
        for s in shards:
            try:
                h = safe_open(s, framework="pt")
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{s}: cannot read safetensors header ({e}); truncated or corrupt?") from None
            self._handles[s] = h
            if not os.path.isfile(index):
                for name in h.keys():
                    self._where[name] = s

    def has(self, name: str) -> bool:
        return name in (self._pickled if self._pickled is not None else self._where)

    def get(self, name: str) -> torch.Tensor:
        if self._pickled is not None:
            if name not in self._pickled:
                raise CheckpointError(f"{self.path}: tensor {name!r} missing")
            return self._pickled[name]
        if name not in self._where:
            raise CheckpointError(f"{self.path}: tensor {name!r} missing from the checkpoint")
        shard = self._where[name]
        try:
            return self._handles[shard].get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise CheckpointError(f"{shard}: cannot read tensor {name!r} ({e}); truncated?") from None

    def source_files(self) -> List[str]:
        files = [os.path.join(self.path, "config.json")]
        files += sorted(set(self._where.values())) if self._pickled is None else []
        return files

    def copy_tokenizer_files(self) -> List[str]:
        return [os.path.join(self.path, f) for f in TOKENIZER_FILES if os.path.isfile(os.path.join(self.path, f))]
