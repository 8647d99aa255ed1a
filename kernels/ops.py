"""Op registry used by the ModelRunner: one function per op, picked per device.

CUDA tensors go to the Triton kernels; CPU tensors to torch (the references or leaner torch
forms of them) and, for bfloat16, to the native kernels of cpu_native (every CPU: one build per ISA path)
(attention of every query row, the element-wise steps, the GEMMs), all batch-invariant: a row's
bits do not depend on the other rows of a step (docs/determinism.md). CPU linears are packed
and dispatched in one place, cpu_linear.py (pack_cpu_linear / cpu_linear below).
`TRITIUM_KERNELS=reference|triton` forces the CPU path or the Triton side (TRITIUM_NATIVE_CPU=0
keeps the CPU path on torch alone); forcing triton for CPU tensors needs `TRITON_INTERPRET=1`
(Triton's interpreter).
The Triton modules are imported lazily: `@triton.jit` fixes compiled-vs-interpreted at import,
and CPU-only installs need not have triton at all.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from typing import Optional

from . import cpu_native
from .gemm_ref import fp8_gemm_ref, w4a16_gemm_ref, w8a16_gemm_ref
from .kv_write_ref import kv_write_ref
from . import cpu_linear as _cpu_linear
from .moe_cpu import fused_moe_cpu
from .attention_split import attention_split
from .attention_cpu import CpuAttentionPlan, paged_attention_cpu, plan_attention
from .rms_norm_ref import rms_norm_cpu
from .rotary_ref import rotary_cpu, rotary_ref, rotary_tables
from .silu_mul_ref import silu_mul_ref

import torch

VALID_MODES = ("auto", "reference", "triton")
_FP8 = torch.float8_e4m3fn


def kernel_mode() -> str:
    mode = os.environ.get("TRITIUM_KERNELS", "auto")
    if mode not in VALID_MODES:
        raise ValueError(f"TRITIUM_KERNELS={mode!r}; allowed: {', '.join(VALID_MODES)}")
    return mode


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")


def use_triton(t) -> bool:
    """Whether an op on tensor `t` runs the Triton kernel (else the torch reference)."""
    mode = kernel_mode()
    if mode == "reference":
        return False
    if mode == "triton":
        if not t.is_cuda and not _interpreting():
            raise ValueError("TRITIUM_KERNELS=triton on CPU tensors needs TRITON_INTERPRET=1 "
                             "(Triton's interpreter); or use TRITIUM_KERNELS=reference|auto")
        return True
    return t.is_cuda and _has_triton()


@functools.lru_cache(maxsize=None)
def _has_triton() -> bool:
    """auto mode on a GPU without the triton package runs the torch references instead."""
    return importlib.util.find_spec("triton") is not None


def _fp8_kernels_ok(t) -> bool:
    """Triton handles E4M3 only from compute capability 8.9 (Ada/Hopper); older GPUs use torch."""
    return not t.is_cuda or torch.cuda.get_device_capability(t.device) >= (8, 9)


def _tk(module: str):
    return importlib.import_module(f".{module}", __package__)


def rms_norm(x, weight, eps, residual=None):
    if use_triton(x):
        return _tk("elementwise_triton").rms_norm(x, weight, eps, residual)
    if x.dim() == 2 and cpu_native.glue_ok(x, x.shape[1]) and weight.dtype == x.dtype:
        return cpu_native.add_rms_norm_bf16(x, weight, eps, residual)
    return rms_norm_cpu(x, weight, eps, residual)


def rotary_prepare(positions, cos_sin_cache, dtype):
    """Per-step rotary state shared by all layers: the CPU path's cos / signed-sin tables, or
    None where the Triton kernel reads the cache itself."""
    if use_triton(cos_sin_cache):
        return None
    return rotary_tables(positions, cos_sin_cache, dtype)


def rotary(q, k, positions, cos_sin_cache, tables=None):
    if use_triton(q):
        return _tk("elementwise_triton").rotary(q, k, positions, cos_sin_cache)
    if tables is not None:
        return rotary_cpu(q, k, tables)
    return rotary_ref(q, k, positions, cos_sin_cache)


def silu_mul(x):
    if use_triton(x):
        return _tk("elementwise_triton").silu_mul(x)
    if x.dim() == 2 and cpu_native.glue_ok(x, x.shape[1] // 2):
        return cpu_native.silu_mul_bf16(x)
    return silu_mul_ref(x)


def can_fuse_rotary_kv_write(qkv, head_dim, k_cache, tables) -> bool:
    """Whether rotary_kv_write takes this step: the CPU path with per-step tables, a bfloat16
    qkv and an unquantized bfloat16 cache."""
    return (tables is not None and k_cache.dtype == qkv.dtype and k_cache.is_contiguous()
            and cpu_native.glue_ok(qkv, head_dim // 2))


def rotary_kv_write(qkv, num_heads, num_kv_heads, head_dim, tables, k_cache, v_cache, slot_mapping):
    """RoPE on q and k of a fused qkv (T, (Hq + 2 Hkv) D), k and v stored in their cache slots,
    one call (the CPU kernel of cpu_glue.c); returns the rotated q (T, Hq, D)."""
    return cpu_native.rotary_kv_write_bf16(qkv, num_heads, num_kv_heads, head_dim, tables, k_cache, v_cache,
                                           slot_mapping)


def kv_write(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
    if use_triton(k) and (k_cache.dtype != _FP8 or _fp8_kernels_ok(k)):
        return _tk("kv_write_triton").kv_write(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return kv_write_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def attention_plan(meta) -> Optional[CpuAttentionPlan]:
    """The per-step state of CPU attention (attention_cpu.CpuAttentionPlan), built once per step
    and kept in AttentionMetadata.cpu_plan; None where the Triton kernels run (their per-step
    index tensors, attention_split.AttentionSplit, go to meta.split instead)."""
    if use_triton(meta.block_tables):
        meta.split = attention_split(meta)
        return None
    return plan_attention(meta)


def paged_attention(q, k_cache, v_cache, meta, scale, sliding_window=None, k_scale=None, v_scale=None,
                    softcap=None, sinks=None):
    """Mixed prefill/decode batch; Triton side routes decode rows to split-K paged decode.
    softcap: scores -> softcap * tanh(scores / softcap) before the mask and softmax (Gemma 2).
    sinks: (Hq,) per-head logits added to each softmax's denominator (gpt-oss), or None."""
    if use_triton(q) and (k_cache.dtype != _FP8 or _fp8_kernels_ok(q)):
        return _tk("attention_prefill_triton").paged_attention(q, k_cache, v_cache, meta, scale, sliding_window,
                                                        k_scale, v_scale, softcap=softcap, sinks=sinks)
    # CPU (same contract as attention_ref.paged_attention_ref, the oracle)
    return paged_attention_cpu(q, k_cache, v_cache, meta, scale, sliding_window, k_scale, v_scale,
                               softcap=softcap, sinks=sinks)


def mla_attention(q, latent_cache, meta, scale, rank):
    """Multi-head latent attention, absorbed form (contract: mla_ref.mla_attention_ref): q (T, H,
    rank + rope), the latent cache (num_blocks, block_size, 1, rank + rope) -> (T, H, rank). Triton:
    mla_triton.mla_attention (decode and prompt rows in one launch). CPU: the paged attention of
    one KV head whose K and V are both the cache row, V's rope tail dropped."""
    if use_triton(q):
        return _tk("mla_triton").mla_attention(q, latent_cache, meta, scale, rank)
    return paged_attention_cpu(q, latent_cache, latent_cache, meta, scale)[..., :rank]


def pack_cpu_linear(method: str, buffers: dict, dtype, group_size=None, deterministic: bool = False,
                    activation_quant: str = "none"):
    """A linear layer's weight packed for its CPU kernel (a cpu_linear.CpuLinear, or None for a
    dense weight that plain F.linear serves). method: 'none' | 'int8' | 'fp8' | 'int4' | 'int6';
    buffers: the layer's tensors by engine name (weight / qweight, scales, zeros, g_idx);
    dtype: the engine dtype; deterministic: never use oneDNN (see cpu_linear.py);
    activation_quant: 'int8' runs int8 / int4 weights on the integer-dot kernel (W8A8 / W4A8)."""
    if method == "none":
        return _cpu_linear.pack_dense(buffers["weight"], deterministic)
    if method == "int8":
        return _cpu_linear.pack_int8(buffers["qweight"], buffers["scales"], buffers.get("zeros"), group_size, dtype,
                                     activation_quant)
    if method == "fp8":
        return _cpu_linear.pack_fp8(buffers["qweight"], buffers["scales"], buffers.get("zeros"), group_size, dtype)
    if method == "int6":
        return _cpu_linear.pack_int6(buffers["qweight"], buffers["scales"], group_size, dtype, activation_quant)
    if method == "int4":
        return _cpu_linear.pack_int4(buffers["qweight"], buffers["scales"], buffers.get("zeros"), group_size,
                                     buffers.get("g_idx"), dtype, activation_quant)
    raise ValueError(f"linear method {method!r}; allowed: none, int8, fp8, int4, int6")


def can_pack_dense_cpu(weight) -> bool:
    """Whether pack_cpu_linear('none', ...) has a packed kernel for this dense weight."""
    return _cpu_linear.dense_packable(weight)


def cpu_linear(x, packed, out_dtype=None):
    """x (M, K) @ W^T with a pack_cpu_linear weight (float32 or the compute dtype; the caller
    rounds once to the engine dtype; out_dtype bfloat16 lets a kernel round it, cpu_linear.run)."""
    return _cpu_linear.run(x, packed, out_dtype)


def linear_w4a16(x, qweight, scales, zeros, group_size, g_idx=None, bias=None):
    """x (..., K) @ int4 weight (packed layout of gemm_ref.py)^T (+ bias)."""
    if use_triton(x):
        return _tk("gemm_triton").w4a16_gemm(x, qweight, scales, zeros, group_size, g_idx, bias)
    return w4a16_gemm_ref(x, qweight, scales, zeros, group_size, g_idx, bias)


def linear_w8a16(x, qweight, scales, bias=None, zeros=None, group_size=None):
    """Weight-only int8 (or fp8) GEMM: x @ (qweight * scales[:, None])^T (+ bias); with group_size,
    the grouped layout x @ (qweight * scales[g, n] + zeros[g, n])^T."""
    if use_triton(x) and (qweight.dtype != _FP8 or _fp8_kernels_ok(x)):
        return _tk("gemm_triton").w8a16_gemm(x, qweight, scales, bias, zeros=zeros, group_size=group_size)
    return w8a16_gemm_ref(x, qweight, scales, bias, zeros, group_size)


def linear_fp8(x, qweight, scales, bias=None):
    """FP8 W8A8 with dynamic per-token activation scales (amax / 448)."""
    if use_triton(x) and _fp8_kernels_ok(x):
        return _tk("gemm_triton").fp8_gemm(x, qweight, scales, bias)
    return fp8_gemm_ref(x, qweight, scales, bias)


def fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids, act_mul=silu_mul_ref, b_gate_up=None, b_down=None):
    """Mixture-of-experts FFN (kernels/moe_ref.py has the formula): the Triton grouped GEMMs on
    GPU, on CPU only the experts that received tokens (moe_cpu.py). Experts are float (E, N, K)
    tensors or moe_ref.QuantExperts (int8, mxfp4, and fp8 from compute capability 8.9: in the Triton
    kernel; int4: dequantized per routed expert by the torch path); b_gate_up (E, 2I) / b_down (E, H):
    gpt-oss's expert biases."""
    methods = {getattr(w, "method", None) for w in (w_gate_up, w_down)}
    torch_path = "int4" in methods or ("fp8" in methods and not _fp8_kernels_ok(x))
    if use_triton(x) and not torch_path:  # int4 experts: the torch path on any device (dequantized per routed expert)
        return _tk("moe_triton").fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids, act_mul, b_gate_up, b_down)
    return fused_moe_cpu(x, w_gate_up, w_down, topk_weights, topk_ids, act_mul, b_gate_up, b_down)
