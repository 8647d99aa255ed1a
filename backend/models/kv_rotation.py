"""Hadamard rotation of the quantized KV cache's head dimension (QuaRot: Ashkboos et al., 2024,
"QuaRot: Outlier-Free 4-Bit Inference in Rotated LLMs", which rotates K and V with Hadamard
matrices before they are quantized).

H is the normalized Sylvester-Hadamard matrix of order D (a power of two): symmetric and
orthonormal, so H @ H = I. The decoder stores K' = K H and V' = V H and rotates the query by the
same H, so every score q'.k' = q H H^T k = q.k and the attention output sum_j p_j v_j H comes back
with one more multiplication by H. In exact arithmetic nothing changes; what changes is what the
cache has to represent.

Why it helps a quantized cache: the rounding error of a stored key element moves the score by
q_i * k_i * eps_i. When a few channels carry most of both q and k (SmolLM2's low-frequency RoPE
channels do), those few products carry the whole score, and their relative error is the score's.
After H every channel holds a +-1/sqrt(D) mix of all of them, so the error of the score averages
over D independent roundings instead of a few. For an INT8 grid the per-head scale also stops being
set by a single outlier channel.
"""
from __future__ import annotations

import functools

import torch


def rotation_supported(head_dim: int) -> bool:
    """Sylvester's construction exists for powers of two only."""
    return head_dim >= 1 and head_dim & (head_dim - 1) == 0


@functools.lru_cache(maxsize=16)
def _hadamard_cpu(n: int) -> torch.Tensor:
    if not rotation_supported(n):
        raise ValueError(f"Hadamard rotation needs head_dim a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / n ** 0.5).float()


_DEVICE_CACHE: dict = {}


def hadamard(n: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """The normalized (n, n) Sylvester-Hadamard matrix on device/dtype (cached)."""
    key = (n, str(device), dtype)
    h = _DEVICE_CACHE.get(key)
    if h is None:
        h = _DEVICE_CACHE[key] = _hadamard_cpu(n).to(device=device, dtype=dtype)
    return h


def rotate(x: torch.Tensor) -> torch.Tensor:
    """x (..., D) @ H: the cache-side coordinates of K or V (and of the query for K)."""
    return x @ hadamard(x.shape[-1], x.device, x.dtype)
