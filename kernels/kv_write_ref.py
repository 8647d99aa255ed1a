"""KV-cache write: scatter the new tokens' K/V into their cache slots.

Quantized caches store round(x / scale) per KV head: INT8 saturates to [-127, 127], FP8 E4M3 to
+-448. Scales have shape (num_kv_heads,) and are fixed at build time.
"""
from __future__ import annotations

from typing import Optional

import torch

FP8_E4M3_MAX = 448.0


def quantize_kv_ref(x: torch.Tensor, scale: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """x: (T, Hkv, D) float; scale: (Hkv,) float32. Returns x / scale in cache_dtype."""
    y = x.float() / scale.float()[None, :, None]
    if cache_dtype == torch.int8:
        return y.round().clamp(-127, 127).to(torch.int8)
    return y.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(cache_dtype)


def dequantize_kv_ref(x: torch.Tensor, scale: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Inverse of quantize_kv_ref over any (..., Hkv, D) cache view; no-op if scale is None."""
    if scale is None:
        return x.to(dtype)
    return (x.float() * scale.float()[:, None]).to(dtype)


def kv_write_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: Optional[torch.Tensor] = None,
                 v_scale: Optional[torch.Tensor] = None) -> None:
    """Write k, v (T, Hkv, D) into caches (num_blocks, block_size, Hkv, D) at flat slots (T,)."""
    num_blocks, block_size, hkv, d = k_cache.shape
    kc = k_cache.view(num_blocks * block_size, hkv, d)
    vc = v_cache.view(num_blocks * block_size, hkv, d)
    if k_scale is not None:
        k = quantize_kv_ref(k, k_scale, k_cache.dtype)
        v = quantize_kv_ref(v, v_scale, v_cache.dtype)
    kc[slot_mapping] = k.to(k_cache.dtype)
    vc[slot_mapping] = v.to(v_cache.dtype)
