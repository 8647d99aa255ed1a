"""Recognise a pre-quantized checkpoint from config.json's `quantization_config` and check that
Tritium can import it exactly, before any tensor is read.

Supported (everything else fails here with the field, its value and the supported values):
- GPTQ (gptqmodel / AutoGPTQ): bits 4, sym or asym, desc_act (g_idx), checkpoint_format
  "gptq" (v1: zero points stored minus one) or "gptq_v2", pack_dtype int32.
- AWQ (AutoAWQ): version "gemm", w_bit 4, zero_point true or false.
- compressed-tensors (llm-compressor): int4 (group / channel, sym / asym) and int8 (channel,
  symmetric), packed (pack-quantized) or not (int-quantized / naive-quantized); fp8 E4M3
  (float-quantized; tensor / channel; input activation scales are ignored: Tritium runs these
  weight-only).
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Optional

from ..convert import CheckpointError

FORMATS = ("gptq", "awq", "compressed-tensors")
GPTQ_CHECKPOINT_FORMATS = ("gptq", "gptq_v2")
AWQ_VERSIONS = ("gemm",)
# pack-quantized packs sub-byte codes into int32; the other three (one compressor in
# compressed-tensors) store the codes unpacked, in int8 / float8_e4m3fn
CT_FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized")
CT_UNPACKED = ("int-quantized", "float-quantized", "naive-quantized")


@dataclass(frozen=True)
class WeightScheme:
    """How one linear's weight is stored (after parsing; the same for the three formats)."""
    kind: str                       # "int4" | "int8" | "fp8"
    group_size: Optional[int]       # int4 / int8 group strategy; None = one scale per output channel (or tensor)
    symmetric: bool = True
    strategy: str = "group"         # compressed-tensors: group | channel | tensor
    ct_format: Optional[str] = None  # compressed-tensors: the module's compression format
    activation_scheme: Optional[str] = None  # e.g. "fp8 dynamic per-token": ignored on import


@dataclass(frozen=True)
class ImportSpec:
    """A checked `quantization_config`. `summary` is recorded as engine.json quantization.imported."""
    format: str                                   # one of FORMATS
    summary: dict
    default: Optional[WeightScheme] = None        # gptq / awq: every linear of the decoder layers
    groups: tuple = ()                            # compressed-tensors: ((targets, WeightScheme), ...)
    ignore: tuple = ()                            # module names / "re:" patterns kept in float
    gptq_v1_zeros: bool = False                   # GPTQ "v1": stored zero points are z - 1

    def scheme_for(self, module: str) -> Optional[WeightScheme]:
        """The scheme of HF module `module` (e.g. model.layers.0.self_attn.q_proj), None if float."""
        if any(_matches(p, module) for p in self.ignore):
            return None
        if self.format != "compressed-tensors":
            return self.default
        for targets, scheme in self.groups:
            if any(t == "Linear" or _matches(t, module) for t in targets):
                return scheme
        return None


def _matches(pattern: str, module: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return pattern == module or module.endswith("." + pattern)


def _bad(path: str, field_name: str, value, allowed) -> CheckpointError:
    return CheckpointError(f"{path}: quantization_config.{field_name} = {value!r} is not supported for import; "
                           f"supported: {allowed}")


def detect_import(raw_config: dict, path: str = "config.json") -> Optional[ImportSpec]:
    """ImportSpec of a checkpoint whose config.json has a quantization_config, else None."""
    qc = raw_config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise CheckpointError(f"{path}: quantization_config must be a JSON object")
    method = str(qc.get("quant_method", qc.get("method", ""))).lower()
    if method == "gptq":
        return _gptq(qc, path)
    if method == "awq":
        return _awq(qc, path)
    if method == "compressed-tensors":
        return _compressed(qc, path)
    raise _bad(path, "quant_method", qc.get("quant_method", qc.get("method")), ", ".join(FORMATS))


# Older AutoGPTQ / AutoAWQ releases kept the quantization settings beside config.json only.
LEGACY_CONFIG_FILES = ("quantize_config.json", "quant_config.json")


def detect_import_in(folder: str, raw_config: dict) -> Optional[ImportSpec]:
    """detect_import for a checkpoint folder: config.json's quantization_config, else a legacy
    quantize_config.json (AutoGPTQ: has `bits`) / quant_config.json (AutoAWQ: has `w_bit`)."""
    if raw_config.get("quantization_config") is not None:
        return detect_import(raw_config, os.path.join(folder, "config.json"))
    for name in LEGACY_CONFIG_FILES:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            continue
        try:
            with open(path) as f:
                qc = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: cannot read ({e})") from None
        if isinstance(qc, dict) and ("bits" in qc or "w_bit" in qc or "quant_method" in qc):
            qc = {"quant_method": "awq" if "w_bit" in qc else "gptq", **qc}
            return detect_import({"quantization_config": qc}, path)
    return None


def _check_int4_group(path: str, field_name: str, g) -> Optional[int]:
    if g is None or g == -1:
        return None
    if not isinstance(g, int) or g <= 0 or g % 32:
        raise _bad(path, field_name, g, "-1 (per output channel) or a positive multiple of 32")
    return g


def _gptq(qc: dict, path: str) -> ImportSpec:
    bits = qc.get("bits")
    if bits != 4:
        raise _bad(path, "bits", bits, "4")
    fmt = str(qc.get("checkpoint_format", qc.get("format", "gptq")) or "gptq").lower()
    if fmt not in GPTQ_CHECKPOINT_FORMATS:
        raise _bad(path, "checkpoint_format", fmt, ", ".join(GPTQ_CHECKPOINT_FORMATS))
    pack = str(qc.get("pack_dtype", "int32"))
    if pack != "int32":
        raise _bad(path, "pack_dtype", pack, "int32")
    for name in ("lm_head", "dynamic", "rotation", "activation"):
        if qc.get(name):
            raise _bad(path, name, qc[name], "false / none (not imported: a quantized lm_head, per-module "
                       "overrides, rotations and activation quantization have no Tritium layout)")
    if qc.get("is_marlin_format"):
        raise _bad(path, "is_marlin_format", qc["is_marlin_format"], "false")
    g = _check_int4_group(path, "group_size", qc.get("group_size", 128))
    sym = bool(qc.get("sym", True))
    desc_act = bool(qc.get("desc_act", False))
    summary = {"format": "gptq", "bits": 4, "group_size": g if g is not None else -1, "desc_act": desc_act,
               "sym": sym, "checkpoint_format": fmt}
    return ImportSpec("gptq", summary, default=WeightScheme("int4", g, sym), gptq_v1_zeros=(fmt == "gptq"),
                      ignore=tuple(qc.get("modules_to_not_convert") or ()))


def _awq(qc: dict, path: str) -> ImportSpec:
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise _bad(path, "bits", bits, "4")
    version = str(qc.get("version", "gemm")).lower()
    if version not in AWQ_VERSIONS:
        raise _bad(path, "version", qc.get("version"), ", ".join(AWQ_VERSIONS) + " (AutoAWQ's GEMM layout)")
    g = _check_int4_group(path, "group_size", qc.get("group_size", qc.get("q_group_size", 128)))
    zero_point = bool(qc.get("zero_point", True))
    summary = {"format": "awq", "bits": 4, "group_size": g if g is not None else -1, "zero_point": zero_point,
               "version": version}
    return ImportSpec("awq", summary, default=WeightScheme("int4", g, not zero_point),
                      ignore=tuple(qc.get("modules_to_not_convert") or ()))


def _compressed(qc: dict, path: str) -> ImportSpec:
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise _bad(path, "quantization_status", status, "compressed")
    for name in ("sparsity_config", "transform_config", "kv_cache_scheme"):
        if qc.get(name):
            raise _bad(path, name, qc[name], "empty (sparsity, transforms and KV-cache schemes are not imported)")
    top_format = qc.get("format")
    groups_cfg = qc.get("config_groups")
    if not isinstance(groups_cfg, dict) or not groups_cfg:
        raise CheckpointError(f"{path}: quantization_config.config_groups is missing or empty")
    groups, kinds = [], {}
    for gname, g in groups_cfg.items():
        scheme = _ct_scheme(g, top_format, f"config_groups.{gname}", path)
        targets = tuple(g.get("targets") or ())
        if not targets:
            raise CheckpointError(f"{path}: quantization_config.config_groups.{gname}.targets is empty")
        groups.append((targets, scheme))
        kinds[gname] = {"format": scheme.ct_format, "kind": scheme.kind, "strategy": scheme.strategy,
                        "group_size": scheme.group_size, "symmetric": scheme.symmetric,
                        **({"activations": scheme.activation_scheme + " (ignored: Tritium runs weight-only)"}
                           if scheme.activation_scheme else {})}
    summary = {"format": "compressed-tensors", "version": qc.get("version"), "groups": kinds,
               "ignore": list(qc.get("ignore") or ())}
    return ImportSpec("compressed-tensors", summary, groups=tuple(groups), ignore=tuple(qc.get("ignore") or ()))


def _ct_scheme(g: dict, top_format, where: str, path: str) -> WeightScheme:
    w = g.get("weights")
    if not isinstance(w, dict):
        raise _bad(path, f"{where}.weights", w, "a weight quantization scheme")
    fmt = g.get("format") or top_format
    if fmt not in CT_FORMATS:
        raise _bad(path, f"{where}.format", fmt, ", ".join(CT_FORMATS))
    if g.get("output_activations"):
        raise _bad(path, f"{where}.output_activations", g["output_activations"], "null")
    bits, wtype = w.get("num_bits"), str(w.get("type", "int"))
    strategy = str(w.get("strategy") or ("group" if (w.get("group_size") or 0) > 0 else
                                         "channel" if w.get("group_size") == -1 else "tensor"))
    sym = bool(w.get("symmetric", True))
    if w.get("dynamic"):
        raise _bad(path, f"{where}.weights.dynamic", w.get("dynamic"), "false")
    if w.get("block_structure"):
        raise _bad(path, f"{where}.weights.block_structure", w.get("block_structure"), "null")
    actorder = w.get("actorder")
    if actorder not in (None, False, "weight", "static", "group", "dynamic"):
        raise _bad(path, f"{where}.weights.actorder", actorder, "null, weight, static, group")
    act = _ct_activations(g.get("input_activations"), wtype, bits, where, path)
    if wtype == "int" and bits == 4:
        if strategy not in ("group", "channel"):
            raise _bad(path, f"{where}.weights.strategy", strategy, "group, channel (4-bit)")
        gs = _check_int4_group(path, f"{where}.weights.group_size", w.get("group_size") if strategy == "group" else -1)
        return WeightScheme("int4", gs, sym, strategy, fmt, act)
    if wtype == "int" and bits == 8:
        if strategy not in ("group", "channel"):
            raise _bad(path, f"{where}.weights.strategy", strategy, "group, channel (8-bit integer)")
        if not sym:
            raise _bad(path, f"{where}.weights.symmetric", w.get("symmetric"), "true (8-bit integer)")
        gs = _check_int4_group(path, f"{where}.weights.group_size", w.get("group_size") if strategy == "group" else -1)
        return WeightScheme("int8", gs, True, strategy, fmt, act)
    if wtype == "float" and bits == 8:
        if fmt not in CT_UNPACKED:
            raise _bad(path, f"{where}.format", fmt, ", ".join(CT_UNPACKED) + " (for fp8 weights)")
        if strategy not in ("tensor", "channel"):
            raise _bad(path, f"{where}.weights.strategy", strategy, "tensor, channel (fp8)")
        if not sym:
            raise _bad(path, f"{where}.weights.symmetric", w.get("symmetric"), "true (fp8)")
        return WeightScheme("fp8", None, True, strategy, fmt, act)
    raise _bad(path, f"{where}.weights (type, num_bits)", (wtype, bits), "(int, 4), (int, 8), (float, 8)")


def _ct_activations(a, wtype: str, bits, where: str, path: str) -> Optional[str]:
    """Input activation quantization: only FP8 activations beside FP8 weights are accepted, and
    ignored (Tritium's CPU path is weight-only); integer activation schemes are refused."""
    if not a:
        return None
    if wtype == "float" and bits == 8 and str(a.get("type")) == "float" and a.get("num_bits") == 8:
        return f"fp8 {'dynamic' if a.get('dynamic') else 'static'} per-{a.get('strategy', 'tensor')}"
    raise _bad(path, f"{where}.input_activations", a, "null (weight-only), or fp8 activations beside fp8 weights")
