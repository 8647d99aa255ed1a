"""Quantized linear layers (weight-only INT8 / FP8 / INT4); models.linear.make_linear picks them by method.

Buffers are named as the engine stores them (tritium.kernels.quant_layouts):
    int8: qweight int8 (N, K), scales float32 (N,)
    fp8:  qweight float8_e4m3fn (N, K), scales float32 (N,)
    int8 / fp8 with LayerQuant.group_size: scales float32 (K//G, N), zeros float32 (K//G, N) when
          LayerQuant.asymmetric
    int4: qweight uint8 (N, K//2), scales/zeros (K//G, N) stored float16, held float32, optional g_idx int32 (K,)
    bias (engine dtype, optional) for all.
On CPU the layers convert their weights once (lazily, on the first call after a load or a device
move) into the layout of torch's packed kernels and never dequantize the whole weight per step,
except FP8, which CPU torch has no GEMM for: it is weight-only and dequantized per call.
On CUDA they call tritium.kernels.ops.linear_w4a16 / linear_w8a16 / linear_fp8 when present.
"""
from __future__ import annotations

import threading

import torch
from torch import nn

from tritium.kernels import cpu_native, ops
from tritium.kernels.int8pack_guard import int8pack_mm_safe
from tritium.kernels.quant_layouts import dequantize_grouped, dequantize_int4, unpack_int4

# From this many rows on, Int8Linear on CPU runs the native AVX512-BF16 kernel (kernels/cpu_gemm.c)
# instead of torch's _weight_int8pack_mm: about 1.5x faster at 16-64 rows, slower for one row.
NATIVE_INT8_MIN_ROWS = 8
# From this many rows on (prefill chunks), Int8Linear converts its weight to bfloat16 (exact) in a
# scratch buffer and runs oneDNN's bf16 GEMM, then applies the scales: the conversion costs about
# as much as 10 rows of the int8 kernel, and oneDNN's GEMM is ~2x faster per row at this size.
DEQUANT_INT8_MIN_ROWS = 64
# Likewise for int4 from 64 rows on: the weight dequantized to bfloat16 (each value rounded once,
# a relative change of at most 2^-9, far below the 4-bit step) and oneDNN's bf16 GEMM.
DEQUANT_INT4_MIN_ROWS = 64
_scratch = threading.local()  # .bufs: numel -> bf16 buffer shared by a thread's quantized layers


def _scratch_bf16(shape) -> torch.Tensor:
    bufs = _scratch.__dict__.setdefault("bufs", {})
    numel = shape[0] * shape[1]
    if numel not in bufs:
        bufs[numel] = torch.empty(numel, dtype=torch.bfloat16)
    return bufs[numel].view(shape)


def _cpu_compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # torch's packed CPU kernels take bf16 or fp32 activations; fp16 runs in fp32.
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


class _QuantLinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, layer_quant):
        super().__init__()
        self.in_features, self.out_features, self.dtype = in_features, out_features, dtype
        self.layer_quant = layer_quant
        self.register_buffer("bias", torch.empty(out_features, dtype=dtype) if bias else None)
        self._packed = None   # kernel-ready tensors, rebuilt when the source buffers change
        self._packed_key = None

    def _get_packed(self):
        # Identity of the source buffers: a load or .to(device) swaps them and forces a repack.
        key = tuple(self._buffers.values())
        if self._packed is None or len(key) != len(self._packed_key) or any(
                a is not b for a, b in zip(key, self._packed_key)):
            self._packed = self._pack()
            self._packed_key = key
        return self._packed

    def prepare_for_device(self, device) -> None:
        """Called by the engine loader after a device move: convert to the kernel layout now."""
        if torch.device(device).type == "cpu" and hasattr(self, "_pack"):
            self._get_packed()

    def _finish(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        y = y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


def _int4_form(q: torch.Tensor, scales: torch.Tensor, zeros, group_size: int):
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


def _register_group_params(mod: nn.Module, layer_quant, what: str) -> None:
    """scales (K//G, N) and, for asymmetric groups, zeros (K//G, N) of a grouped int8 / fp8 layer;
    per-output-channel scales (N,) when the layer has no group size."""
    g = getattr(layer_quant, "group_size", None)
    mod.group_size = g
    if g is None and getattr(layer_quant, "asymmetric", False):
        raise ValueError(f"{what} layer: asymmetric needs a group_size (zeros are per group)")
    if g is None:
        mod.register_buffer("scales", torch.empty(mod.out_features, dtype=torch.float32))
        mod.register_buffer("zeros", None)
        return
    if g <= 0 or mod.in_features % g:
        raise ValueError(f"{what} layer: group_size {g} must divide in_features {mod.in_features}")
    shape = (mod.in_features // g, mod.out_features)
    mod.register_buffer("scales", torch.empty(shape, dtype=torch.float32))
    asym = bool(getattr(layer_quant, "asymmetric", False))
    mod.register_buffer("zeros", torch.empty(shape, dtype=torch.float32) if asym else None)


class Int8Linear(_QuantLinearBase):
    """W8A16: y = x (qweight * scales[:, None])^T via aten._weight_int8pack_mm on CPU.

    Grouped (layer_quant.group_size): y = x (qweight * scales[g] + zeros[g])^T. On CPU the native
    kernel (kernels/cpu_gemm.c: each 32-weight block dequantized once to bfloat16 and shared by up
    to 8 rows); prefill-sized batches dequantize to bfloat16 once per call into a scratch buffer
    and use oneDNN. Without the native kernel: torch's packed int4 GEMM where every group's codes
    fit 4 bits (a 4-bit source grid, see _int4_form), else a dense bfloat16 copy."""

    def __init__(self, in_features, out_features, bias, dtype, layer_quant=None):
        super().__init__(in_features, out_features, bias, dtype, layer_quant)
        self.register_buffer("qweight", torch.empty(out_features, in_features, dtype=torch.int8))
        _register_group_params(self, layer_quant, "int8")

    def _pack(self):
        if self.group_size is not None:
            native = cpu_native.supports(self.in_features) and self.group_size % 32 == 0 and cpu_native.available()
            zeros = self.zeros.float().contiguous() if self.zeros is not None else None
            qw = self.qweight.clone(memory_format=torch.contiguous_format)
            if native:
                return ("native", qw, self.scales.float().contiguous(), zeros,
                        cpu_native.pack_group_params(self.scales, zeros))
            # No native kernel here (another CPU, odd shapes): torch's packed int4 GEMM where the
            # codes fit 4 bits (measured slower than the native kernel on SmolLM2, 1 thread:
            # 0.80x vs 1.04x of bf16 at batch 1), else one dense bfloat16 copy.
            four = _int4_form(qw, self.scales.float(), zeros, self.group_size)
            if four is not None:
                return ("int4", qw, self.scales.float().contiguous(), zeros, four)
            return ("dense", dequantize_grouped(self.qweight, self.scales, self.zeros, self.group_size,
                                                torch.bfloat16), None, None, None)
        # bf16 always: torch's fp32 int8 path is much slower for M > 1 (see Int4Linear._pack).
        # clone: a fresh, 64-byte-aligned copy. Tensors from safetensors' load_file can sit at
        # any 8-byte offset of the file, and the packed kernel's vector loads crash on those.
        return (self.qweight.clone(memory_format=torch.contiguous_format), self.scales.to(torch.bfloat16),
                self.scales.float().contiguous())

    def _forward_grouped(self, x2: torch.Tensor) -> torch.Tensor:
        # four: the int4 form (kind "int4") or the native kernel's packed group parameters
        kind, qw, scales, zeros, four = self._get_packed()
        if kind == "dense":
            return torch.nn.functional.linear(x2.to(torch.bfloat16), qw)
        if kind == "int4":
            packed, sz = four
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x2.to(torch.bfloat16).contiguous(), packed,
                                                              self.group_size, sz)
        if x2.shape[0] >= DEQUANT_INT8_MIN_ROWS:
            w = cpu_native.int8g_to_bf16(qw, scales, zeros, self.group_size, _scratch_bf16(qw.shape))
            return torch.nn.functional.linear(x2.to(torch.bfloat16), w)
        return cpu_native.w8g_gemm(x2, qw, four, self.group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if x.is_cuda and hasattr(ops, "linear_w8a16"):
            if self.group_size is not None:
                return self._finish(ops.linear_w8a16(x2, self.qweight, self.scales, zeros=self.zeros,
                                                     group_size=self.group_size), x)
            return self._finish(ops.linear_w8a16(x2, self.qweight, self.scales), x)
        if x.is_cuda:  # no kernel: dense fallback in the activation dtype
            return self._finish(x2 @ self._dequantize(x.dtype).t(), x)
        if self.group_size is not None:
            return self._finish(self._forward_grouped(x2), x)
        qw, scales, scales_f32 = self._get_packed()
        if x2.shape[0] >= DEQUANT_INT8_MIN_ROWS and cpu_native.available():
            w = cpu_native.int8_to_bf16(qw, _scratch_bf16(qw.shape))
            y = torch.nn.functional.linear(x2.to(torch.bfloat16), w).float() * scales_f32
            return self._finish(y, x)
        if x2.shape[0] >= NATIVE_INT8_MIN_ROWS and cpu_native.supports(self.in_features) \
                and cpu_native.available():
            return self._finish(cpu_native.w8a16_gemm(x2, qw, scales_f32), x)
        if not int8pack_mm_safe(self.in_features):
            # widths where torch's packed kernel is known to crash (kernels/int8pack_guard.py)
            w = qw.to(torch.bfloat16)
            return self._finish(torch.nn.functional.linear(x2.to(torch.bfloat16), w).float() * scales_f32, x)
        y = torch.ops.aten._weight_int8pack_mm(x2.to(scales.dtype).contiguous(), qw, scales)
        return self._finish(y, x)

    def _dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        if self.group_size is not None:
            return dequantize_grouped(self.qweight, self.scales, self.zeros, self.group_size, dtype)
        return self.qweight.to(dtype) * self.scales.to(dtype)[:, None]


class Fp8Linear(_QuantLinearBase):
    """FP8 E4M3 weights. CPU: weight-only, dequantized per call; CUDA: ops.linear_fp8 (dynamic
    per-token activation quantization where the device has FP8 matmul). Grouped (layer_quant.
    group_size): weight-only everywhere, ops.linear_w8a16 with the group scales / zeros on CUDA."""

    def __init__(self, in_features, out_features, bias, dtype, layer_quant=None):
        super().__init__(in_features, out_features, bias, dtype, layer_quant)
        if not hasattr(torch, "float8_e4m3fn"):
            raise ValueError("fp8 engine: this torch build has no float8_e4m3fn dtype")
        self.register_buffer("qweight", torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn))
        _register_group_params(self, layer_quant, "fp8")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if self.group_size is not None:
            if x.is_cuda and hasattr(ops, "linear_w8a16"):
                return self._finish(ops.linear_w8a16(x2, self.qweight, self.scales, zeros=self.zeros,
                                                     group_size=self.group_size), x)
            cdtype = _cpu_compute_dtype(self.dtype) if not x.is_cuda else x.dtype
            w = dequantize_grouped(self.qweight, self.scales, self.zeros, self.group_size, cdtype)
            return self._finish(x2.to(cdtype) @ w.t(), x)
        if x.is_cuda and hasattr(ops, "linear_fp8"):
            return self._finish(ops.linear_fp8(x2, self.qweight, self.scales), x)
        cdtype = _cpu_compute_dtype(self.dtype) if not x.is_cuda else x.dtype
        # y = (x W8^T) * s: the per-output-channel scale commutes with the matmul, so only the
        # E4M3 -> compute-dtype cast of the weight is done per call.
        y = x2.to(cdtype) @ self.qweight.to(cdtype).t()
        return self._finish(y * self.scales.to(cdtype), x)


class Int4Linear(_QuantLinearBase):
    """W4A16 group-wise asymmetric: aten._weight_int4pack_mm_for_cpu on CPU.

    With act-order (g_idx), input channels are permuted once at load so that each group is
    contiguous, and x is permuted the same way at run time.
    """

    def __init__(self, in_features, out_features, bias, dtype, layer_quant=None):
        super().__init__(in_features, out_features, bias, dtype, layer_quant)
        group_size = getattr(layer_quant, "group_size", None)
        if not group_size or in_features % group_size:
            raise ValueError(f"int4 layer: group_size {group_size} must divide in_features {in_features}")
        self.group_size = group_size
        num_groups = in_features // group_size
        self.register_buffer("qweight", torch.empty(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("scales", torch.empty(num_groups, out_features, dtype=torch.float32))
        self.register_buffer("zeros", torch.empty(num_groups, out_features, dtype=torch.float32))
        act_order = bool(getattr(layer_quant, "act_order", False))
        self.register_buffer("g_idx", torch.empty(in_features, dtype=torch.int32) if act_order else None)

    def _pack(self):
        # bf16 always: torch's fp32 int4 path is a scalar loop (~100x slower for M > 1), and bf16
        # activation rounding (2^-9) is far below the 4-bit weight error.
        cdtype = torch.bfloat16
        q = unpack_int4(self.qweight).to(torch.int32)
        perm = None
        if self.g_idx is not None:
            perm = torch.argsort(self.g_idx.long(), stable=True)
            expected = torch.arange(self.in_features, device=perm.device) // self.group_size
            if not torch.equal(self.g_idx.long()[perm], expected):
                raise ValueError("int4 layer: g_idx must assign exactly group_size channels to each group")
            q = q[:, perm].contiguous()
        sz = torch.stack((self.scales, self.zeros), dim=-1).to(cdtype).contiguous()  # (K/G, N, 2)
        try:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
            return ("packed", packed, sz, perm)
        except RuntimeError:
            # Shapes the packed kernel rejects (tiny test models): keep one dense copy instead.
            w = dequantize_int4(self.qweight, self.scales, self.zeros, self.group_size, self.g_idx, cdtype)
            return ("dense", w, None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if x.is_cuda and hasattr(ops, "linear_w4a16"):
            y = ops.linear_w4a16(x2, self.qweight, self.scales, self.zeros, self.group_size, self.g_idx)
            return self._finish(y, x)
        if x.is_cuda:
            w = dequantize_int4(self.qweight, self.scales, self.zeros, self.group_size, self.g_idx, x.dtype)
            return self._finish(x2 @ w.t(), x)
        kind, w, sz, perm = self._get_packed()
        if kind == "packed" and x2.shape[0] >= DEQUANT_INT4_MIN_ROWS and cpu_native.available():
            wb = cpu_native.int4_to_bf16(self.qweight, self.scales, self.zeros, self.group_size, self.g_idx,
                                         _scratch_bf16((self.out_features, self.in_features)))
            return self._finish(torch.nn.functional.linear(x2.to(torch.bfloat16), wb), x)
        xc = x2.to(sz.dtype if sz is not None else w.dtype)
        if kind == "dense":
            return self._finish(xc @ w.t(), x)
        if perm is not None:
            xc = xc[:, perm]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xc.contiguous(), w, self.group_size, sz)
        return self._finish(y, x)
