"""CPU linear layers: the one place that chooses a kernel for a weight, packs the weight for it
once, and runs it (the layer classes in backend/ call this through ops.pack_cpu_linear /
ops.cpu_linear and hold the returned CpuLinear).

Numerics, by engine dtype:
- bfloat16 engine, native kernels available (every path of kernels/cpu_native.py): every
  quantized GEMM reduces each output in float32 in one order fixed by K (cpu_gemm*.c) and the
  result is rounded once to bfloat16 by the layer, so a row is the same bits alone or in any batch.
  The fused kernels (w8a16, w8g, w4) serve small batches; from DEQUANT_MIN_ROWS rows the weight is
  dequantized to bfloat16 into a scratch buffer and multiplied by the native bf16 GEMM, which gives
  the same bits (same per-32 dequantization, same accumulation order), so the switch is invisible.
  Dense bf16 weights take the native bf16 GEMM too (as fast as oneDNN's pre-packed bf16 GEMM
  from 16 to 256 rows at SmolLM2's shapes on the avx512 path, faster at 1-8 rows; docs/kernels.md),
  so every linear of a bf16 engine can run inside the native decode step. TRITIUM_CPU_ONEDNN=1
  (read when a weight is packed) puts dense bf16 weights with K <= ONEDNN_INVARIANT_MAX_K on
  oneDNN (pre-packed) instead, as before, where its result was measured batch-invariant (above
  that K oneDNN's bf16 GEMM splits K differently with M, see tests/test_determinism_kernels.py);
  `deterministic` (an engine option) never uses oneDNN. Such an engine runs per-op (the native
  step cannot call oneDNN). oneDNN also packs dense weights when the native kernels are off.
- float32 (and float16) engines: the quantized weight is dequantized once to float32 and the GEMM
  runs and returns float32, as float weights do (so tensor-parallel partial sums are never
  rounded to bfloat16).
- bfloat16 without the native kernels (TRITIUM_NATIVE_CPU=0, no C compiler): torch's packed int8 /
  int4 kernels (their blocking and bf16 scales depend on the batch; not batch-invariant).
- activation_quant "int8" (an engine option, docs/quantization.md#integer-dot-w8a8--w4a8): int8
  and int4 linears run the integer-dot kernel (cpu_gemm_i8dot.c; W8A8 / W4A8: activations
  quantized per row and block of 32) for every row count, so a row's result is the same alone,
  in a batch or in a prefill; the weight is repacked once (i8dot_pack.repack; asymmetric int4:
  its zeros folded into the integer codes where every block allows it) and no weight-only
  copy is kept. Where the kernel cannot run (no native library, K or the group size not a
  multiple of 32) the layer keeps its weight-only kernel. An int6 head (pack_int6) runs
  cpu_head.c on its 6-bit codes instead (W6A8, the same bits as its codes widened to int8
  through the integer-dot kernel); LM heads of bfloat16 engines take this branch even in
  weight-only engines (backend/quant.py head_activation_quant, TRITIUM_HEAD_DOT).
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from . import cpu_native
from . import head_pack
from . import i8dot_pack
from .int8pack_guard import int8pack_mm_safe
from .quant_layouts import dequantize_grouped, dequantize_int4, pack_int4 as pack_nibbles, unpack_int4, unpack_int6

# From this many rows on, quantized weights are dequantized to bfloat16 once per call and the
# native bf16 GEMM runs (the conversion costs about as much as 10 rows of the fused kernels).
DEQUANT_MIN_ROWS = 64
# Largest K for which oneDNN's pre-packed bf16 GEMM gave every row the same bits for every M
# (1..512, SmolLM2 and test shapes, 1 and 2 threads); from K = 1088 on, rows differ from M = 2..23.
ONEDNN_INVARIANT_MAX_K = 1024
I4_FOLD_ENV = "TRITIUM_I4_FOLD"  # "0": W4A8 keeps the float zero term (the stored grid exactly)
HEAD_DOT_ENV = "TRITIUM_HEAD_DOT"  # "0": LM heads of weight-only engines stay weight-only (backend/quant.py)
ONEDNN_ENV = "TRITIUM_CPU_ONEDNN"  # "1": dense bf16 weights with K <= ONEDNN_INVARIANT_MAX_K on oneDNN
_scratch = threading.local()  # .bufs: numel -> bf16 buffer shared by a thread's quantized layers


def _scratch_bf16(shape) -> torch.Tensor:
    bufs = _scratch.__dict__.setdefault("bufs", {})
    numel = shape[0] * shape[1]
    if numel not in bufs:
        bufs[numel] = torch.empty(numel, dtype=torch.bfloat16)
    return bufs[numel].view(shape)


@dataclass
class CpuLinear:
    """A weight in the form its CPU kernel takes. kind names the kernel (see run())."""
    kind: str
    tensors: Tuple
    group_size: Optional[int] = None
    perm: Optional[torch.Tensor] = None  # act-order: x's columns are permuted by this first


def _native(k: int, group_size: Optional[int] = None) -> bool:
    return cpu_native.supports(k) and (group_size is None or group_size % 32 == 0) and cpu_native.available()


def dense_packable(weight: torch.Tensor) -> bool:
    """Whether pack_dense has a kernel for this weight: bf16 on CPU, native kernels or oneDNN."""
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
            and (cpu_native.available() or _onednn_packing()))


def pack_dense(weight: torch.Tensor, deterministic: bool) -> Optional[CpuLinear]:
    """A bf16 dense weight's CPU form, or None where plain F.linear is the kernel."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
        return None
    k = weight.shape[1]
    native = cpu_native.available()
    if native and (deterministic or not onednn_requested() or k > ONEDNN_INVARIANT_MAX_K
                   or not cpu_native.has_bf16_dot()):
        return CpuLinear("bf16_native", (weight.contiguous(),))
    if _onednn_packing():
        return CpuLinear("onednn", (torch.ops.mkldnn._reorder_linear_weight(weight, None),))
    return None


def onednn_requested() -> bool:
    """TRITIUM_CPU_ONEDNN=1: dense bf16 weights with K <= ONEDNN_INVARIANT_MAX_K on oneDNN."""
    v = os.environ.get(ONEDNN_ENV, "0")
    if v not in ("0", "1"):
        raise ValueError(f"{ONEDNN_ENV} must be 0 or 1, got {v!r}")
    return v == "1"


def _onednn_packing() -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()) and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    except (AttributeError, RuntimeError):
        return False


ACTIVATION_QUANT = ("none", "int8")  # the engine option's values: weight-only, or W8A8 / W4A8


def _i8dot_ok(k: int, group_size: Optional[int], activation_quant: str) -> bool:
    if activation_quant not in ACTIVATION_QUANT:
        raise ValueError(f"activation_quant must be one of {', '.join(ACTIVATION_QUANT)}, got {activation_quant!r}")
    return activation_quant == "int8" and i8dot_pack.repackable(k, group_size) and cpu_native.available()


def pack_int8(qweight, scales, zeros, group_size, dtype: torch.dtype, activation_quant: str = "none") -> CpuLinear:
    """int8 per-channel (scales (N,)) or grouped (scales / zeros (K//G, N)) weights."""
    k = qweight.shape[1]
    if _i8dot_ok(k, group_size, activation_quant):
        return CpuLinear("i8dot", (i8dot_pack.repack(qweight, scales, zeros, group_size, 8),))
    if dtype != torch.bfloat16:
        w = (dequantize_grouped(qweight, scales, zeros, group_size, torch.float32) if group_size is not None
             else qweight.float() * scales.float()[:, None])
        return CpuLinear("dense_f32", (w.contiguous(),))
    # clone: a fresh, 64-byte-aligned copy (safetensors tensors can sit at any 8-byte offset)
    qw = qweight.clone(memory_format=torch.contiguous_format)
    z = zeros.float().contiguous() if zeros is not None else None
    if group_size is not None:
        if _native(k, group_size):
            s = scales.float().contiguous()
            return CpuLinear("int8g_native", (qw, s, z, cpu_native.pack_group_params(s, z)), group_size)
        # No native kernel here (another CPU, odd shapes): torch's packed int4 GEMM where every
        # group's codes fit 4 bits (a 4-bit source grid), else one dense bfloat16 copy.
        four = int4_form(qw, scales.float(), z, group_size)
        if four is not None:
            return CpuLinear("int4pack", four, group_size)
        return CpuLinear("dense_bf16", (dequantize_grouped(qweight, scales, zeros, group_size, torch.bfloat16),))
    if _native(k):
        return CpuLinear("int8_native", (qw, scales.float().contiguous()))
    return CpuLinear("int8pack", (qw, scales.to(torch.bfloat16), scales.float().contiguous()))


def i4_fold_enabled() -> bool:
    """TRITIUM_I4_FOLD (default 1): asymmetric int4 layers of W4A8 engines fold their zeros into
    the integer codes (i8dot_pack.repack fold, the zeros rounded to 1/8 of the block scale); 0 keeps
    the float zero term (the stored grid exactly; the kernels' former numerics). Read at load."""
    v = os.environ.get(I4_FOLD_ENV, "1")
    if v not in ("0", "1"):
        raise ValueError(f"{I4_FOLD_ENV} must be 0 or 1, got {v!r}")
    return v == "1"


def head_dot_enabled() -> bool:
    """TRITIUM_HEAD_DOT (default 1): the int6 / grouped int8 LM heads of bfloat16 weight-only
    engines run integer-dot (backend/quant.py head_activation_quant); 0 keeps them weight-only."""
    v = os.environ.get(HEAD_DOT_ENV, "1")
    if v not in ("0", "1"):
        raise ValueError(f"{HEAD_DOT_ENV} must be 0 or 1, got {v!r}")
    return v == "1"


def pack_int6(qweight, scales, group_size, dtype: torch.dtype, activation_quant: str = "none") -> CpuLinear:
    """The int6 embedding / LM head (quant_layouts.INT6_LAYOUT, qweight the stored uint8 (N, 3K/4)):
    the integer-dot head on its 6-bit codes (cpu_head.c, W6A8) with activation_quant "int8",
    else the codes widened to int8 for the int8 kernels (weight-only, pack_int8)."""
    codes = unpack_int6(qweight) if qweight.dtype == torch.uint8 else qweight
    k = codes.shape[1]
    if _i8dot_ok(k, group_size, activation_quant) and head_pack.repackable(k, group_size):
        return CpuLinear("head6", (head_pack.repack6(codes, scales, group_size),))
    return pack_int8(codes, scales, None, group_size, dtype, activation_quant)


def int4_form(q: torch.Tensor, scales: torch.Tensor, zeros, group_size: int):
    """torch's packed int4 form (packed weight, bf16 (K/G, N, 2) scale/zero) of a grouped int8
    weight whose codes in every group take at most 16 evenly spaced values (a 4-bit source grid
    kept by the builder: Q4_1 lands on codes 17 q - 128), else None. With c = cmin + t j,
    j = 0..15: w = c s + z = (j - 8) (t s) + (cmin s + z + 8 t s). The scale and zero are then
    rounded to bfloat16, as for int4 engines (relative 2^-9)."""
    n, k = q.shape
    c = q.view(n, k // group_size, group_size).to(torch.int32)
    cmin = c.amin(dim=2)
    d = c - cmin[:, :, None]
    t = d[:, :, 0]
    for j in range(1, group_size):
        t = torch.gcd(t, d[:, :, j])
    t = t.clamp_min(1)
    if bool((d.amax(dim=2) > 15 * t).any()):
        return None
    j = (d // t[:, :, None]).reshape(n, k)
    try:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(j.contiguous(), 1)
    except RuntimeError:
        return None
    st = scales.t() * t  # (N, K/G)
    zt = cmin * scales.t() + (zeros.t() if zeros is not None else 0.0) + 8 * st
    sz = torch.stack((st.t(), zt.t()), dim=-1).to(torch.bfloat16).contiguous()  # (K/G, N, 2)
    return packed, sz


def pack_fp8(qweight, scales, zeros, group_size, dtype: torch.dtype) -> CpuLinear:
    """FP8 E4M3 weight-only: E4M3 values are exact in bfloat16 and float32."""
    cdtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    if group_size is not None:
        # the grouped value q * s + z is rounded to bfloat16 once (as int8g_to_bf16 does)
        return CpuLinear("dense_bf16" if cdtype == torch.bfloat16 else "dense_f32",
                         (dequantize_grouped(qweight, scales, zeros, group_size, cdtype).contiguous(),))
    if cdtype == torch.float32:
        return CpuLinear("dense_f32", ((qweight.float() * scales.float()[:, None]).contiguous(),))
    return CpuLinear("fp8_scaled", (qweight, scales.float().contiguous()))


def pack_int4(qweight, scales, zeros, group_size: int, g_idx, dtype: torch.dtype,
              activation_quant: str = "none") -> CpuLinear:
    """int4 layout of gemm_ref.w4a16_gemm_ref (zeros None: symmetric); act-order (g_idx) input channels permuted once so
    that every group is contiguous (x is permuted the same way per call)."""
    k = 2 * qweight.shape[1]
    if _i8dot_ok(k, group_size, activation_quant):
        q, perm = _int4_codes(qweight, g_idx, group_size, k)
        return CpuLinear("i8dot", (i8dot_pack.repack(q - 8, scales, zeros, group_size, 4, fold=i4_fold_enabled()),),
                         group_size, perm)
    if dtype != torch.bfloat16:
        return CpuLinear("dense_f32", (dequantize_int4(qweight, scales, zeros, group_size, g_idx,
                                                       torch.float32).contiguous(),))
    q, perm = _int4_codes(qweight, g_idx, group_size, k)
    half = _half_params(scales, zeros)
    if _native(k, group_size) and half is not None:
        # the 16-bit parameters as stored (the kernels widen them in registers); zeros None
        # (symmetric): the kernels take zero 0
        return CpuLinear("int4_native", (pack_nibbles(q),) + half, group_size, perm)
    if _native(k, group_size):  # parameters float16 cannot hold (imported float32 zeros): a bf16 copy
        w = dequantize_int4(qweight, scales, zeros, group_size, g_idx, torch.bfloat16)
        return CpuLinear("bf16_native", (w.contiguous(),))
    z = zeros if zeros is not None else torch.zeros_like(scales)
    sz = torch.stack((scales, z), dim=-1).to(torch.bfloat16).contiguous()  # (K/G, N, 2)
    try:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
        return CpuLinear("int4pack", (packed, sz), group_size, perm)
    except RuntimeError:  # shapes the packed kernel rejects (tiny test models): one dense copy
        w = dequantize_int4(qweight, scales, zeros, group_size, g_idx, torch.bfloat16)
        return CpuLinear("dense_bf16", (w,))


def _half_params(scales, zeros):
    """(scales, zeros) as contiguous float16 when every value is a float16 value (Tritium's own
    builds store float16), else None; zeros may be None."""
    out = []
    for t in (scales, zeros):
        if t is None:
            out.append(None)
            continue
        h = t.to(torch.float16)
        if t.dtype != torch.float16 and not torch.equal(h.float(), t.float()):
            return None
        out.append(h.contiguous())
    return tuple(out)


def _int4_codes(qweight, g_idx, group_size: int, k: int):
    """Codes 0..15 (N, K) int32 with act-order channels permuted so each group is contiguous, and
    the permutation (None without g_idx)."""
    q = unpack_int4(qweight).to(torch.int32)
    perm = None
    if g_idx is not None:
        perm = torch.argsort(g_idx.long(), stable=True)
        if not torch.equal(g_idx.long()[perm], torch.arange(k) // group_size):
            raise ValueError("int4 layer: g_idx must assign exactly group_size channels to each group")
        q = q[:, perm].contiguous()
    return q, perm


def run(x: torch.Tensor, p: CpuLinear, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """x (M, K) @ W^T for a packed weight: float32 (M, N) from the native and float32 kinds,
    the compute dtype from the others; the caller rounds once to the engine dtype. out_dtype
    bfloat16 lets the dense native GEMM round in the kernel (same bits, half the bytes written)."""
    m = x.shape[0]
    if p.perm is not None:
        x = x[:, p.perm]
    if p.kind == "dense_f32":
        return torch.nn.functional.linear(x.float(), p.tensors[0])
    if p.kind == "i8dot":
        return cpu_native.i8dot_gemm(x, p.tensors[0])
    if p.kind == "head6":
        return cpu_native.head6_gemm(x, p.tensors[0])
    if p.kind == "onednn":
        return torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), p.tensors[0], None, "none", [], "")
    if p.kind == "bf16_native":
        return cpu_native.bf16_gemm(x, p.tensors[0], torch.bfloat16 if out_dtype == torch.bfloat16 else torch.float32)
    if p.kind == "dense_bf16":
        return torch.nn.functional.linear(x.to(torch.bfloat16), p.tensors[0])
    if p.kind == "int8_native":
        qw, s = p.tensors
        if m >= DEQUANT_MIN_ROWS:
            return cpu_native.bf16_gemm(x, cpu_native.int8_to_bf16(qw, _scratch_bf16(qw.shape))).mul_(s)
        return cpu_native.w8a16_gemm(x, qw, s)
    if p.kind == "int8g_native":
        qw, s, z, params = p.tensors
        if m >= DEQUANT_MIN_ROWS:
            return cpu_native.bf16_gemm(x, cpu_native.int8g_to_bf16(qw, s, z, p.group_size, _scratch_bf16(qw.shape)))
        return cpu_native.w8g_gemm(x, qw, params, p.group_size)
    if p.kind == "int4_native":
        qw, s, z = p.tensors
        if m >= DEQUANT_MIN_ROWS:
            shape = (qw.shape[0], 2 * qw.shape[1])
            return cpu_native.bf16_gemm(x, cpu_native.int4_to_bf16(qw, s, z, p.group_size, None, _scratch_bf16(shape)))
        return cpu_native.w4_gemm(x, qw, s, z, p.group_size)
    if p.kind == "fp8_scaled":
        qw, s = p.tensors
        if cpu_native.available():
            w = _scratch_bf16(qw.shape)
            w.copy_(qw)  # E4M3 -> bf16 is exact
            return cpu_native.bf16_gemm(x, w).mul_(s)
        return (x.to(torch.bfloat16) @ qw.to(torch.bfloat16).t()).float() * s
    if p.kind == "int8pack":
        qw, s_bf16, s = p.tensors
        if not int8pack_mm_safe(qw.shape[1]):  # widths where torch's kernel crashes (int8pack_guard.py)
            return torch.nn.functional.linear(x.to(torch.bfloat16), qw.to(torch.bfloat16)).float() * s
        return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), qw, s_bf16)
    if p.kind == "int4pack":
        packed, sz = p.tensors
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16).contiguous(), packed,
                                                          p.group_size, sz)
    raise AssertionError(f"unknown CPU linear kind {p.kind!r}")
