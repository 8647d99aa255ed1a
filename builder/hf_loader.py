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

from tritium.backend.config import SUPPORTED_ROPE_TYPES, ModelConfig, RopeConfig
from tritium.backend.models.families import BY_MODEL_TYPE, FamilyConfigError

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


def _rope(rp: dict, cfg: dict, arch: str, rotary_dim: int, max_pos: int, path: str, where: str) -> RopeConfig:
    """One RopeConfig from a rope_parameters-style dict (`where` names it in errors)."""
    theta = float(rp.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rtype = rp.get("rope_type", rp.get("type", "default")) or "default"
    if arch == "phi3" and rtype in ("su", "yarn"):  # Phi-3's old names for LongRoPE
        rtype = "longrope"
    if rtype not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(f"{path}: {where}.rope_type {rtype!r} is not supported; supported: "
                              f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    orig = rp.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
    factor = rp.get("factor")
    if rtype in ("linear", "dynamic", "llama3", "yarn") and factor is None:
        raise CheckpointError(f"{path}: {where}.factor is required for rope_type {rtype!r}")
    if rtype in ("llama3", "longrope") and orig is None:
        raise CheckpointError(f"{path}: {where}.original_max_position_embeddings is required for rope_type {rtype!r}")
    if rtype == "longrope":
        factor = factor if factor is not None else max_pos / orig
        for key in ("short_factor", "long_factor"):
            f = rp.get(key)
            if not isinstance(f, list) or len(f) != rotary_dim // 2:
                raise CheckpointError(f"{path}: {where}.{key} must list rotary_dim / 2 = {rotary_dim // 2} numbers, "
                                      f"got {f if not isinstance(f, list) else f'{len(f)} entries'}")
    opt = {k: float(rp[k]) for k in ("beta_fast", "beta_slow") if rp.get(k) is not None}
    return RopeConfig(theta=theta, scaling_type=rtype, factor=float(factor if factor is not None else 1.0),
                      low_freq_factor=float(rp.get("low_freq_factor", 1.0)),
                      high_freq_factor=float(rp.get("high_freq_factor", 4.0)),
                      original_max_position_embeddings=orig, mscale=rp.get("mscale"),
                      mscale_all_dim=rp.get("mscale_all_dim"), truncate=bool(rp.get("truncate", True)),
                      attention_factor=rp.get("attention_factor"),
                      short_factor=tuple(float(x) for x in rp.get("short_factor") or ()) if rtype == "longrope" else (),
                      long_factor=tuple(float(x) for x in rp.get("long_factor") or ()) if rtype == "longrope" else (),
                      **opt)


def _layer_types(cfg: dict, family, layers: int, path: str) -> Optional[list]:
    lt = cfg.get("layer_types")
    if lt is None and family.default_sliding is not None:
        lt = ["sliding_attention" if family.default_sliding(cfg, i) else "full_attention" for i in range(layers)]
    if lt is None:
        return None
    if len(lt) != layers:
        raise CheckpointError(f"{path}: layer_types has {len(lt)} entries, num_hidden_layers is {layers}")
    bad = [t for t in lt if t not in ("sliding_attention", "full_attention")]
    if bad:
        raise CheckpointError(f"{path}: layer_types entry {bad[0]!r} is not supported; supported: "
                              f"sliding_attention, full_attention")
    return lt


def model_config_from_hf(cfg: dict, path: str = "config.json") -> ModelConfig:
    """Translate an HF config.json dict into a ModelConfig (errors name the field and the value).

    The contract of every source: a GGUF file is read into an HF-style dict and comes here too.
    What differs per family is declared in backend/models/families/."""
    arch = cfg.get("model_type")
    family = BY_MODEL_TYPE.get(arch)
    if family is None:
        raise CheckpointError(f"{path}: model_type {arch!r} is not supported; supported: "
                              f"{', '.join(sorted(BY_MODEL_TYPE))}")
    hidden = int(_req(cfg, "hidden_size", path))
    heads = int(_req(cfg, "num_attention_heads", path))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    layers = int(_req(cfg, "num_hidden_layers", path))
    max_pos = int(cfg.get("max_position_embeddings", 2048))
    # transformers >= 5 nests rope settings in rope_parameters (per layer type for Gemma 3);
    # older files use rope_theta / rope_scaling / partial_rotary_factor / rope_local_base_freq.
    rp_all = dict(cfg.get("rope_parameters") or {})
    per_type = isinstance(rp_all.get("full_attention"), dict) or isinstance(rp_all.get("sliding_attention"), dict)
    rp = dict(rp_all.get("full_attention") or {}) if per_type else rp_all
    rp = {**dict(cfg.get("rope_scaling") or {}), **rp}
    partial = float(rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) or 1.0)
    rotary_dim = int(head_dim * partial)
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise CheckpointError(f"{path}: partial_rotary_factor {partial} gives rotary dimension {rotary_dim}; "
                              f"it must be even and in (0, head_dim {head_dim}]")
    rope = _rope(rp, cfg, arch, rotary_dim, max_pos, path, "rope_parameters")
    rope_local = None
    if per_type and rp_all.get("sliding_attention") is not None:
        rope_local = _rope(dict(rp_all["sliding_attention"]), {}, arch, rotary_dim, max_pos, path,
                           "rope_parameters.sliding_attention")
    elif cfg.get("rope_local_base_freq") is not None:
        rope_local = RopeConfig(theta=float(cfg["rope_local_base_freq"]))
    windows: tuple = ()
    sw = cfg.get("sliding_window")
    if cfg.get("use_sliding_window") is False:
        sw = None  # Qwen2 / Qwen3 / SmolLM3 keep the field (Qwen2-MoE as 0) but switch it off
    lt = _layer_types(cfg, family, layers, path)
    if sw is not None and (not isinstance(sw, int) or sw <= 0):
        raise CheckpointError(f"{path}: sliding_window {sw!r} must be a positive integer or null")
    if lt is not None:
        windows = tuple(int(sw) if (t == "sliding_attention" and sw) else None for t in lt)
    elif arch in ("mistral", "phi3", "mixtral") and sw:
        windows = (int(sw),) * layers
    elif arch in ("qwen2", "qwen3") and sw:
        mwl = int(cfg.get("max_window_layers", layers))
        windows = tuple(int(sw) if i >= mwl else None for i in range(layers))
    if windows and all(w is None for w in windows):
        windows = ()
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    try:
        extra = family.hf_fields(cfg)
    except FamilyConfigError as e:
        raise CheckpointError(f"{path}: {e}") from None
    attention_bias = bool(cfg.get("attention_bias", family.default_attention_bias))
    if cfg.get("use_bidirectional_attention"):
        raise CheckpointError(f"{path}: use_bidirectional_attention true is not supported (a causal decoder only)")
    # a family's fields override the shared ones (MLA's head_dim, num_kv_heads, rotary_dim)
    return ModelConfig(**{**dict(
        architecture=family.name, vocab_size=int(_req(cfg, "vocab_size", path)), hidden_size=hidden,
        intermediate_size=int(_req(cfg, "intermediate_size", path)), num_layers=layers,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=max_pos, rope=rope, attention_bias=attention_bias,
        o_proj_bias=attention_bias and family.o_proj_bias,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", family.name in ("gemma2", "gemma3", "smollm3"))),
        sliding_windows=windows, bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids,
        pad_token_id=cfg.get("pad_token_id"), rotary_dim=rotary_dim if rotary_dim != head_dim else None,
        rope_local=rope_local if windows else None), **extra})


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
