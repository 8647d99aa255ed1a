"""Rotary position embedding (RoFormer), neox / HF "rotate_half" layout, Llama-3 scaling.

For a head vector split in halves (x1, x2) and angle theta_p,i = p * inv_freq[i]:
    out1 = x1 * cos - x2 * sin
    out2 = x2 * cos + x1 * sin
"""
from __future__ import annotations

import math
from typing import Tuple

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling_type: str = "default", factor: float = 1.0,
                  low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
                  original_max_position_embeddings=None) -> torch.Tensor:
    """Inverse frequencies (head_dim // 2,) in float32, with linear or Llama-3 scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling_type == "linear":
        inv_freq = inv_freq / factor
    elif scaling_type == "llama3":
        # Llama 3.1 report: keep high frequencies, divide low ones by `factor`,
        # interpolate smoothly in between.
        old_ctx = original_max_position_embeddings
        low_wavelen = old_ctx / low_freq_factor
        high_wavelen = old_ctx / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    elif scaling_type != "default":
        raise ValueError(f"rope scaling type {scaling_type!r} not supported; use default, linear or llama3")
    return inv_freq


def rope_cos_sin_cache(inv_freq: torch.Tensor, max_positions: int) -> torch.Tensor:
    """(max_positions, head_dim) float32 cache holding [cos | sin] of each half-dim angle."""
    t = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def rotary_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               cos_sin_cache: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Reference RoPE. q: (T, Hq, D), k: (T, Hkv, D), positions: (T,). Returns new (q, k)."""
    half = q.shape[-1] // 2
    cs = cos_sin_cache[positions]  # (T, D)
    cos = cs[:, None, :half].to(q.dtype)
    sin = cs[:, None, half:].to(q.dtype)

    def rot(x):
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    return rot(q), rot(k)


def rotary_tables(positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                  dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-step tables for rotary_cpu, shared by every layer of a step: (cos, signed_sin), each
    (T, 1, D) in `dtype`, with cos repeated over both halves and signed_sin = [-sin | sin]."""
    half = cos_sin_cache.shape[1] // 2
    cs = cos_sin_cache[positions]  # (T, D) float32: [cos | sin]
    cos, sin = cs[:, :half], cs[:, half:]
    return (torch.cat([cos, cos], dim=-1).to(dtype)[:, None],
            torch.cat([-sin, sin], dim=-1).to(dtype)[:, None])


def rotary_cpu(q: torch.Tensor, k: torch.Tensor,
               tables: Tuple[torch.Tensor, torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """rotary_ref's result from precomputed tables, in three ATen calls per tensor:
    out = x * cos + swap_halves(x) * signed_sin, i.e. [x1 cos - x2 sin | x2 cos + x1 sin]."""
    cos, ssin = tables
    half = q.shape[-1] // 2

    def rot(x):
        swapped = torch.cat([x[..., half:], x[..., :half]], dim=-1)
        return torch.addcmul(x * cos, swapped, ssin)

    return rot(q), rot(k)
