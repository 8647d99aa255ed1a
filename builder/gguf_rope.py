"""GGUF rope metadata (and the rope tensors llama.cpp stores) -> transformers' rope_parameters.

Linear and YaRN scaling are metadata keys; Phi-3's LongRoPE factors are tensors
(rope_factors_long / short); Llama 3 scaling is stored only as its per-frequency divisors
(rope_freqs.weight), from which its parameters are recovered and checked.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, Set

import numpy as np

from .convert import CheckpointError
from .gguf_meta import Meta, f32


def rope_parameters(m: Meta, tensors: Set[str], read: Callable, head_dim: int) -> dict:
    """rope_parameters (transformers >= 5 spelling, which also reads rope_theta/rope_scaling)."""
    rp: Dict[str, object] = {"rope_type": "default", "rope_theta": m.get("rope.freq_base", 10000.0, float)}
    stype = m.get("rope.scaling.type")
    if "rope_factors_long.weight" in tensors:  # Phi-3 longrope ("su"): the factors are tensors
        rp.update(rope_type="longrope", long_factor=[f32(x) for x in read("rope_factors_long.weight")],
                  short_factor=[f32(x) for x in read("rope_factors_short.weight")])
        orig = m.get("rope.scaling.original_context_length", kind=int)
        if orig is not None:
            rp["original_max_position_embeddings"] = orig
    elif stype in (None, "none"):
        pass
    elif stype == "linear":
        rp.update(rope_type="linear", factor=m.req("rope.scaling.factor", float))
    elif stype == "yarn":
        rp.update(rope_type="yarn", factor=m.req("rope.scaling.factor", float),
                  original_max_position_embeddings=m.req("rope.scaling.original_context_length"))
        for key, hf in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                        ("yarn_attn_factor", "attention_factor")):
            if (v := m.get(f"rope.scaling.{key}", kind=float)) is not None:
                rp[hf] = v
        if (v := m.get("rope.scaling.yarn_ext_factor", kind=float)) is not None and v != 1.0:
            raise CheckpointError(f"{m.path}: metadata {m.arch}.rope.scaling.yarn_ext_factor = {v} is not "
                                  f"supported; allowed: 1.0")
    else:
        raise CheckpointError(f"{m.path}: metadata {m.arch}.rope.scaling.type = {stype!r} is not supported; "
                              f"allowed: none, linear, yarn, longrope")
    if "rope_freqs.weight" in tensors:
        freqs = np.asarray(read("rope_freqs.weight"), dtype=np.float64)
        if not np.all(freqs == 1.0):
            if rp["rope_type"] != "default":
                raise CheckpointError(f"{m.path}: tensor rope_freqs.weight together with rope.scaling.type "
                                      f"{stype!r} is not supported")
            rp.update(_llama3_from_freqs(freqs, rp["rope_theta"], head_dim, m))
    rot = m.get("rope.dimension_count", kind=int)
    if rot is not None and rot not in (head_dim,) and m.arch != "phi3":
        raise CheckpointError(f"{m.path}: metadata {m.arch}.rope.dimension_count = {rot} (partial rotary) is not "
                              f"supported for {m.arch}; allowed: {head_dim} (the head dim)")
    return rp


def _llama3_divisors(theta: float, head_dim: int, p: dict) -> np.ndarray:
    """The per-frequency divisors of Llama 3 rope scaling (transformers' _compute_llama3_parameters,
    which llama.cpp's converter stores as rope_freqs.weight)."""
    wavelen = 2 * math.pi / theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    orig, factor = p["original_max_position_embeddings"], p["factor"]
    low, high = p["low_freq_factor"], p["high_freq_factor"]
    smooth = (orig / wavelen - low) / (high - low)
    mid = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < orig / high, 1.0, np.where(wavelen > orig / low, factor, mid))


def _llama3_from_freqs(freqs: np.ndarray, theta: float, head_dim: int, m: "Meta") -> dict:
    """Llama 3 rope parameters from the divisors llama.cpp stores (rope_freqs.weight).

    The divisors are 1 above the high-frequency wavelength H, `factor` below the low-frequency
    wavelength L, and 1 / ((1 - s) / factor + s) between, with s linear in 1 / wavelength:
    s = (1/wl - 1/L) / (1/H - 1/L). Two or more in-between values fix L and H; the original
    context is taken as L (low_freq_factor 1, as every Llama 3.x has) unless the file states it.
    The result is checked by recomputing every divisor."""
    bad = CheckpointError(f"{m.path}: tensor rope_freqs.weight ({freqs.size} values) is not Llama 3 rope "
                          f"scaling that can be recovered; not supported")
    if freqs.size * 2 != head_dim:
        raise bad
    factor = float(freqs.max())
    wavelen = 2 * math.pi / theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    mid = (freqs > 1 + 1e-6) & (freqs < factor * (1 - 1e-6))
    if mid.sum() < 2:
        raise bad
    s = (1 / freqs[mid] - 1 / factor) / (1 - 1 / factor)
    a, b = np.polyfit(1 / wavelen[mid], s, 1)
    inv_l = -b / a
    inv_h = 1 / a + inv_l
    orig = m.get("rope.scaling.original_context_length", kind=int) or int(round(1 / inv_l))
    p = {"rope_type": "llama3", "factor": f32(factor), "original_max_position_embeddings": orig,
         "low_freq_factor": float(f"{orig * inv_l:.6g}"), "high_freq_factor": float(f"{orig * inv_h:.6g}")}
    if not np.allclose(_llama3_divisors(theta, head_dim, p), freqs, rtol=1e-5, atol=0):
        raise bad
    return p
