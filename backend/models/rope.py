"""Rotary position embedding variants: inverse frequencies and the cos/sin table of one layer kind.

RoPE is from Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding" (2021).
The scaled variants follow their papers and Hugging Face transformers' `ROPE_INIT_FUNCTIONS`
(the tests' oracle):
- linear: position interpolation (Chen et al., "Extending Context Window of Large Language Models
  via Positional Interpolation", 2023): every frequency divided by `factor`.
- dynamic: NTK-aware scaling of the base with the sequence length (bloc97 / Reddit, 2023, as
  transformers implements it). transformers recomputes it per forward from the longest position;
  an engine holds one table, so the table is the one transformers uses for a sequence of the
  engine's `max_seq_len`: identical to the default rotation while `max_seq_len` fits
  `max_position_embeddings`.
- llama3: the Llama 3.1 report's wavelength-banded scaling.
- yarn: Peng et al., "YaRN: Efficient Context Window Extension of Large Language Models" (2023):
  a ramp between interpolated and extrapolated frequencies plus an attention factor that scales
  cos and sin.
- longrope: Ding et al., "LongRoPE: Extending LLM Context Window Beyond 2 Million Tokens" (2024),
  Phi-3's "su": per-frequency rescale factors, the short set for sequences within
  `original_max_position_embeddings`, the long set beyond; the engine takes the set that
  transformers would take for a sequence of `max_seq_len` tokens (short when it fits).
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def _base_inv_freq(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(inv_freq: torch.Tensor, r) -> torch.Tensor:
    old_ctx = r.original_max_position_embeddings
    low_wavelen = old_ctx / r.low_freq_factor
    high_wavelen = old_ctx / r.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / r.factor, inv_freq)
    smooth = (old_ctx / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor)
    smoothed = (1 - smooth) * scaled / r.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, r, max_position_embeddings: int) -> Tuple[torch.Tensor, float]:
    factor = r.factor
    orig = r.original_max_position_embeddings or max_position_embeddings
    attention = r.attention_factor
    if attention is None:
        if r.mscale and r.mscale_all_dim:
            attention = _yarn_mscale(factor, r.mscale) / _yarn_mscale(factor, r.mscale_all_dim)
        else:
            attention = _yarn_mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(r.theta))

    low, high = correction_dim(r.beta_fast), correction_dim(r.beta_slow)
    if r.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = r.theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp  # share of the unscaled frequency
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


def _longrope(dim: int, r, max_position_embeddings: int, seq_len: int) -> Tuple[torch.Tensor, float]:
    orig = r.original_max_position_embeddings or max_position_embeddings
    factor = r.factor  # the builder fills max_position_embeddings / original when the source has none
    attention = r.attention_factor
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    ext = r.long_factor if seq_len > orig else r.short_factor
    if len(ext) != dim // 2:
        raise ValueError(f"rope {'long' if seq_len > orig else 'short'}_factor has {len(ext)} entries; "
                         f"the rotary dimension {dim} needs {dim // 2}")
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (torch.tensor(ext, dtype=torch.float32) * r.theta ** shape), float(attention)


def rope_parameters(r, dim: int, max_position_embeddings: int, seq_len: Optional[int] = None
                    ) -> Tuple[torch.Tensor, float]:
    """(inv_freq (dim // 2,) float32, attention factor) of RopeConfig `r` for a rotary dimension
    `dim`; `seq_len` is the longest sequence the table must serve (dynamic and longrope use it)."""
    t = r.scaling_type
    if t not in ROPE_TYPES:
        raise ValueError(f"rope type {t!r} not supported; supported: {', '.join(ROPE_TYPES)}")
    if t == "yarn":
        return _yarn(dim, r, max_position_embeddings)
    if t == "longrope":
        return _longrope(dim, r, max_position_embeddings, seq_len or max_position_embeddings)
    if t == "dynamic":
        n = max(seq_len or max_position_embeddings, max_position_embeddings)
        base = r.theta * ((r.factor * n / max_position_embeddings) - (r.factor - 1)) ** (dim / (dim - 2))
        return _base_inv_freq(dim, base), 1.0
    inv_freq = _base_inv_freq(dim, r.theta)
    if t == "linear":
        inv_freq = inv_freq / r.factor
    elif t == "llama3":
        inv_freq = _llama3(inv_freq, r)
    return inv_freq, 1.0


def rope_table(r, dim: int, max_position_embeddings: int, max_positions: int) -> torch.Tensor:
    """(max_positions, dim) float32 [cos | sin] table (the layout kernels/rotary_ref.py reads), both
    halves multiplied by the variant's attention factor (as transformers scales cos and sin)."""
    inv_freq, attention = rope_parameters(r, dim, max_position_embeddings, max_positions)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention
