"""Quantized linear layers (weight-only INT8 / FP8 / INT4); models.linear.make_linear picks them by method.

Buffers are named as the engine stores them (tritium.kernels.quant_layouts):
    int8: qweight int8 (N, K), scales (N,)
    fp8:  qweight float8_e4m3fn (N, K), scales (N,)
    int8 / fp8 with LayerQuant.group_size: scales (K//G, N), zeros (K//G, N) when
          LayerQuant.asymmetric
    int4: qweight uint8 (N, K//2), scales/zeros (K//G, N), optional g_idx int32 (K,)
    int6 (embedding / LM head): qweight uint8 (N, 3K//4) (as stored); scales (N,) or (K//G, N)
    bias (engine dtype, optional) for all.
Scales and zeros keep the dtype the engine stores (float16 or bfloat16 since engine format 3,
float32 in older and imported engines; DecoderLM.load_engine_weights): the CPU packing widens
them to float32 once (the native kernels read float32 parameters), the Triton GEMMs read them
as stored and widen each load to float32.
On CPU the layers hand their buffers once (lazily, on the first call after a load or a device
move) to tritium.kernels.ops.pack_cpu_linear, which picks the kernel and its weight layout
(kernels/cpu_linear.py: batch-invariant native kernels in bfloat16 engines, float32 GEMMs in
float32 engines), and run it with ops.cpu_linear; the result is rounded once to the engine dtype.
On CUDA they call ops.linear_w4a16 / linear_w8a16 / linear_fp8.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import nn

from tritium.kernels import cpu_native, head_pack, ops
from tritium.kernels.cpu_linear import ACTIVATION_QUANT, head_dot_enabled
from tritium.kernels.quant_layouts import pack_int6, unpack_int6

from .config import EngineConfig


class _QuantLinearBase(nn.Module):
    method = ""  # the LayerQuant method this class implements
    activation_quant = "none"  # "int8": W8A8 / W4A8 on CPU (set_activation_quant)
    is_head = False  # the logits GEMM (DecoderLM sets it on its LM head): see head_activation_quant

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, layer_quant):
        super().__init__()
        self.in_features, self.out_features, self.dtype = in_features, out_features, dtype
        self.layer_quant = layer_quant
        self.register_buffer("bias", torch.empty(out_features, dtype=dtype) if bias else None)
        self._packed = None   # kernels.cpu_linear.CpuLinear, rebuilt when the source buffers change
        self._packed_key = None

    def _get_packed(self):
        # Identity of the source buffers: a load or .to(device) swaps them and forces a repack.
        key = tuple(self._buffers.values())
        if self._packed is None or len(key) != len(self._packed_key) or any(
                a is not b for a, b in zip(key, self._packed_key)):
            self._packed = ops.pack_cpu_linear(self.method, self._buffers, self.dtype, self.group_size,
                                               activation_quant=self.head_activation_quant())
            self._packed_key = key
        return self._packed

    def head_activation_quant(self) -> str:
        """activation_quant as the CPU kernels take it: an int6 or grouped int8 LM head of a
        bfloat16 engine runs integer-dot even in a weight-only engine (W6A8 / W8A8: the head's
        quality cost measured in docs/quantization.md), unless TRITIUM_HEAD_DOT=0 (read when
        the weight is packed); per-row int8 and int4 heads follow the engine's setting."""
        if (self.is_head and self.activation_quant == "none" and self.dtype == torch.bfloat16
                and (self.method == "int6" or (self.method == "int8" and self.group_size))
                and head_dot_enabled()):
            return "int8"
        return self.activation_quant

    def prepare_for_device(self, device) -> None:
        """Called by the engine loader after a device move: convert to the kernel layout now."""
        if torch.device(device).type == "cpu":
            self._get_packed()

    def _finish(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        y = y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def _cpu(self, x: torch.Tensor) -> torch.Tensor:
        return self._finish(ops.cpu_linear(x.reshape(-1, self.in_features), self._get_packed()), x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


def set_activation_quant(model: nn.Module, mode: str) -> None:
    """EngineConfig.activation_quant for every int8 / int4 linear of `model` ("none" or "int8");
    a layer whose mode changes is packed again on its next CPU call."""
    if mode not in ACTIVATION_QUANT:
        raise ValueError(f"activation_quant must be one of {', '.join(ACTIVATION_QUANT)}, got {mode!r}")
    for mod in model.modules():
        if isinstance(mod, (Int8Linear, Int4Linear)) and mod.activation_quant != mode:
            mod.activation_quant = mode
            mod._packed = None


def with_activation_quant(cfg: EngineConfig, mode: Optional[str]) -> EngineConfig:
    """cfg with the `activation_quant` option overridden (None: the engine's own setting)."""
    if mode is None or mode == cfg.activation_quant:
        return cfg
    if mode not in ACTIVATION_QUANT:
        raise ValueError(f"activation_quant must be one of {', '.join(ACTIVATION_QUANT)}, got {mode!r}")
    if cfg.tensor_parallel_size > 1:
        raise ValueError("activation_quant: a tensor-parallel engine takes it from its build "
                         "(tritium build --activation-quant), not as a runtime override")
    return dataclasses.replace(cfg, activation_quant=mode)


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
    """W8A16: y = x (qweight * scales[:, None])^T; grouped (layer_quant.group_size):
    y = x (qweight * scales[g] + zeros[g])^T. CPU kernels: kernels/cpu_linear.py."""
    method = "int8"

    def __init__(self, in_features, out_features, bias, dtype, layer_quant=None):
        super().__init__(in_features, out_features, bias, dtype, layer_quant)
        self.register_buffer("qweight", torch.empty(out_features, in_features, dtype=torch.int8))
        _register_group_params(self, layer_quant, "int8")

    _panels = None  # a CPU head's integer-dot weight once it holds the only copy of the codes

    def _get_packed(self):
        if self._panels is not None and self._packed is None:  # repacking (another mode): codes back
            self._buffers["qweight"] = self._stored_codes(self._panels)
            self._panels = None
        p = super()._get_packed()
        if self.is_head and p.kind in ("i8dot", "head6") and self._panels is None:
            # The head's panels hold the same codes: the lookup (codes()) reads its rows there, so
            # the matrix is held once; qweight stays an empty placeholder until a repack needs it.
            self._panels = p.tensors[0]
            self._buffers["qweight"] = self.qweight.new_empty((0,) + tuple(self.qweight.shape[1:]))
            self._packed_key = tuple(self._buffers.values())
        return p

    def _stored_codes(self, panels) -> torch.Tensor:
        return head_pack.i8dot_codes(panels).to(torch.int8)

    def codes(self, ids: torch.Tensor) -> torch.Tensor:
        """The int8 codes of output rows `ids` (the embedding lookup)."""
        if self._panels is not None:
            return head_pack.i8dot_codes(self._panels, ids)
        return self.qweight[ids]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_cuda:
            return self._cpu(x)
        x2 = x.reshape(-1, self.in_features)
        return self._finish(ops.linear_w8a16(x2, self.qweight, self.scales, zeros=self.zeros,
                                             group_size=self.group_size), x)


class Int6Linear(Int8Linear):
    """The int6 embedding / LM head (LayerQuant "int6", kernels/quant_layouts.INT6_LAYOUT): the
    engine stores four 6-bit codes in three bytes with a bfloat16 scale per row, or float16
    scales per group of LayerQuant.group_size; w = q * scales[n] (grouped: q * scales[k // G, n]).
    qweight stays as stored (uint8 (N, 3K/4)). On CPU the head is packed by
    kernels/cpu_linear.pack_int6: the integer-dot head on the 6-bit codes (kernels/cpu_head.c,
    repacked once into its panels, which then replace qweight as for int8 heads), or, where that
    is off, the codes widened to int8 for the int8 kernels (the lookup unpacks the gathered rows
    of qweight). On CUDA the codes are widened to int8 once (prepare_for_device, or the first
    call) for the W8A16 GEMM."""
    method = "int6"

    def __init__(self, in_features, out_features, bias, dtype, layer_quant=None):
        if in_features % 4:
            raise ValueError(f"int6 layer: in_features {in_features} must be a multiple of 4")
        super().__init__(in_features, out_features, bias, dtype, layer_quant)
        self.register_buffer("qweight", torch.empty(out_features, 3 * in_features // 4, dtype=torch.uint8))

    def _stored_codes(self, panels) -> torch.Tensor:
        return pack_int6(head_pack.signed_codes(panels))

    def codes(self, ids: torch.Tensor) -> torch.Tensor:
        if self._panels is not None:
            return cpu_native.head6_rows(self._panels, ids)
        q = self.qweight[ids]
        return unpack_int6(q) if q.dtype == torch.uint8 else q

    def int8_codes(self) -> torch.Tensor:
        """The codes widened to int8 (N, K), from wherever this module holds them."""
        if self._panels is not None:
            return head_pack.signed_codes(self._panels)
        return unpack_int6(self.qweight) if self.qweight.dtype == torch.uint8 else self.qweight

    def prepare_for_device(self, device) -> None:
        if torch.device(device).type != "cpu" and self.qweight.dtype == torch.uint8:
            self._buffers["qweight"] = unpack_int6(self.qweight)  # the W8A16 GEMM's int8 codes
        super().prepare_for_device(device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and self.qweight.dtype == torch.uint8:
            self._buffers["qweight"] = unpack_int6(self.qweight)
        return super().forward(x)


class Fp8Linear(_QuantLinearBase):
    """FP8 E4M3 weights. CPU: weight-only (kernels/cpu_linear.py); CUDA: ops.linear_fp8 (dynamic
    per-token activation quantization where the device has FP8 matmul). Grouped (layer_quant.
    group_size): weight-only everywhere, ops.linear_w8a16 with the group scales / zeros on CUDA."""
    method = "fp8"

    def __init__(self, in_features, out_features, bias, dtype, layer_quant=None):
        super().__init__(in_features, out_features, bias, dtype, layer_quant)
        if not hasattr(torch, "float8_e4m3fn"):
            raise ValueError("fp8 engine: this torch build has no float8_e4m3fn dtype")
        self.register_buffer("qweight", torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn))
        _register_group_params(self, layer_quant, "fp8")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_cuda:
            return self._cpu(x)
        x2 = x.reshape(-1, self.in_features)
        if self.group_size is not None:
            return self._finish(ops.linear_w8a16(x2, self.qweight, self.scales, zeros=self.zeros,
                                                 group_size=self.group_size), x)
        return self._finish(ops.linear_fp8(x2, self.qweight, self.scales), x)


class Int4Linear(_QuantLinearBase):
    """W4A16 group-wise: asymmetric (scales and zeros), or symmetric (layer_quant.symmetric: no
    zeros, llama.cpp Q4_0's grid). With act-order (g_idx), input channels are permuted once at
    load so that each group is contiguous, and x is permuted the same way at run time (CPU)."""
    method = "int4"

    def __init__(self, in_features, out_features, bias, dtype, layer_quant=None):
        super().__init__(in_features, out_features, bias, dtype, layer_quant)
        group_size = getattr(layer_quant, "group_size", None)
        if not group_size or in_features % group_size:
            raise ValueError(f"int4 layer: group_size {group_size} must divide in_features {in_features}")
        self.group_size = group_size
        num_groups = in_features // group_size
        self.register_buffer("qweight", torch.empty(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("scales", torch.empty(num_groups, out_features, dtype=torch.float32))
        sym = bool(getattr(layer_quant, "symmetric", False))
        self.register_buffer("zeros", None if sym else torch.empty(num_groups, out_features, dtype=torch.float32))
        act_order = bool(getattr(layer_quant, "act_order", False))
        self.register_buffer("g_idx", torch.empty(in_features, dtype=torch.int32) if act_order else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_cuda:
            return self._cpu(x)
        x2 = x.reshape(-1, self.in_features)
        return self._finish(ops.linear_w4a16(x2, self.qweight, self.scales, self.zeros, self.group_size, self.g_idx), x)
