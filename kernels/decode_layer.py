"""The layer loop of a step in one native call (kernels/cpu_decode_layer.c): the ctypes side.

`DecodeLayers` holds, once per model, a C array of per-layer descriptors (norm weights, the four
linears as their CPU kernels hold them, the layer's KV cache); `run` passes one step's rows. The
per-op path and this call run the same kernels in the same order, so their results are the same
bits (tests/test_native_step.py), on any thread count (tests/test_native_step_threads.py). Which
layers and steps may take it is decided by backend/models/native_step.py.
"""
from __future__ import annotations

import ctypes
from typing import List, Optional, Sequence, Tuple

import torch

from . import cpu_native
from .cpu_linear import CpuLinear

# CpuLinear kind -> the C enum (LIN_*) of cpu_decode_layer.c
LINEAR_KINDS = {"bf16_native": 0, "int8_native": 1, "int8g_native": 2, "int4_native": 3, "i8dot": 4}


class _Linear(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int64), ("n", ctypes.c_int64), ("k", ctypes.c_int64),
                ("group", ctypes.c_int64), ("nz", ctypes.c_int64), ("w", ctypes.c_void_p),
                ("scale", ctypes.c_void_p), ("zero", ctypes.c_void_p), ("params", ctypes.c_void_p),
                ("bias", ctypes.c_void_p), ("d16", ctypes.c_void_p), ("z16", ctypes.c_void_p)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", ctypes.c_void_p), ("post_attn_norm", ctypes.c_void_p),
                ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
                ("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear)]


def linear_supported(p: Optional[CpuLinear]) -> Optional[str]:
    """None where the native layer runs this packed weight, else why not."""
    if p is None:
        return "weight not packed for a CPU kernel"
    if p.kind not in LINEAR_KINDS:
        return f"linear kernel {p.kind!r} (native layer takes {', '.join(LINEAR_KINDS)})"
    if p.perm is not None:
        return "act-order int4 (permuted input channels)"
    return None


def _fill_linear(dst: _Linear, p: CpuLinear, bias: Optional[torch.Tensor], keep: list) -> None:
    kind = LINEAR_KINDS[p.kind]
    t = p.tensors
    if p.kind == "i8dot":  # one I8DotWeight (kernels/i8dot_pack.py): codes, float16 d / z, float32 r
        q = t[0]
        t = (q.codes, q.d, q.r) + ((q.z,) if q.z is not None else ())
        dst.kind, (dst.n, dst.k), dst.group, dst.nz = kind, q.shape, q.kernel_bits, 0  # group: the code layout
        dst.w, dst.d16, dst.scale = q.codes.data_ptr(), q.d.data_ptr(), q.r.data_ptr()
        dst.z16 = q.z.data_ptr() if q.z is not None else None
    else:
        w = t[0]
        k = 2 * w.shape[1] if p.kind == "int4_native" else w.shape[1]
        dst.kind, dst.n, dst.k, dst.group, dst.nz = kind, w.shape[0], k, p.group_size or 0, 0
        dst.w = w.data_ptr()
    if p.kind == "int8_native":
        dst.scale = t[1].data_ptr()
    elif p.kind == "int8g_native":
        dst.params, dst.nz = t[3].data_ptr(), t[3].shape[2]
    elif p.kind == "int4_native":
        dst.scale, dst.zero = t[1].data_ptr(), (t[2].data_ptr() if t[2] is not None else None)  # None: symmetric
    if bias is not None:
        bias = bias.to(torch.bfloat16).contiguous()
        keep.append(bias)
        dst.bias = bias.data_ptr()
    keep.extend(t)


def _lib():
    lib = cpu_native._lib()
    if lib is not None and not hasattr(lib, "tritium_decode_layers_ready"):
        p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
        lib.tritium_decode_layers_workspace.argtypes = [i64] * 6 + [p, p]
        lib.tritium_decode_layers_workspace.restype = None
        lib.tritium_decode_layers_bf16.argtypes = ([p, i64, i64, i64, i64, i64, i64, i64, f32, f32, f32, p, p, i64, p, p,
                                                     p, p, i64, p, i64, i64, p, p, i64])
        lib.tritium_decode_layers_bf16.restype = ctypes.c_int
        lib.tritium_decode_layers_profile.argtypes = [p]
        lib.tritium_decode_layers_profile.restype = None
        lib.tritium_decode_layers_profile_threads.argtypes = [p]
        lib.tritium_decode_layers_profile_threads.restype = None
        lib.tritium_decode_layers_ready = True
    return lib


PROFILE_OPS = ("norm1", "qkv", "rope", "attention", "o", "norm2", "gate_up", "silu", "down", "barrier wait")


def read_profile() -> Tuple[dict, int]:
    """({op: seconds}, steps) of thread 0 in the native step since the last read, then reset;
    all zero unless TRITIUM_STEP_PROFILE=1 was set when the kernels loaded."""
    out = (ctypes.c_int64 * (len(PROFILE_OPS) + 1))()
    _lib().tritium_decode_layers_profile(out)
    return {op: out[i] / 1e9 for i, op in enumerate(PROFILE_OPS)}, out[len(PROFILE_OPS)]


PROFILE_THREADS = 2  # PROF_THREADS of kernels/cpu_step_profile.h


def read_profile_threads() -> Tuple[list, int]:
    """([{op: seconds} of thread 0, of thread 1], steps) since the last read, then reset (as
    read_profile; thread 1's all zero on one thread)."""
    n = len(PROFILE_OPS)
    out = (ctypes.c_int64 * (PROFILE_THREADS * n + 1))()
    _lib().tritium_decode_layers_profile_threads(out)
    return [{op: out[t * n + i] / 1e9 for i, op in enumerate(PROFILE_OPS)} for t in range(PROFILE_THREADS)], out[-1]


class DecodeLayers:
    """A model's layers as the native call takes them.

    layers: per layer (input_norm (H,), post_attn_norm (H,), [qkv, o, gate_up, down] as
    (CpuLinear, bias or None)); dims: H, Hq, Hkv, D, intermediate size I; eps and the softmax
    scale; residual_multiplier (Granite) times the o and down outputs. Every linear must pass
    linear_supported."""

    def __init__(self, layers: Sequence[Tuple[torch.Tensor, torch.Tensor, list]], hidden: int, num_heads: int,
                 num_kv_heads: int, head_dim: int, intermediate: int, eps: float, scale: float,
                 residual_multiplier: float = 1.0):
        self.dims = (hidden, num_heads, num_kv_heads, head_dim, intermediate)
        self.eps, self.scale, self.residual_multiplier = float(eps), float(scale), float(residual_multiplier)
        self._keep: List[torch.Tensor] = []
        self._arr = (_Layer * len(layers))()
        for dst, (n1, n2, lins) in zip(self._arr, layers):
            n1, n2 = n1.contiguous(), n2.contiguous()
            self._keep += [n1, n2]
            dst.input_norm, dst.post_attn_norm = n1.data_ptr(), n2.data_ptr()
            for name, (p, bias) in zip(("qkv", "o", "gate_up", "down"), lins):
                _fill_linear(getattr(dst, name), p, bias, self._keep)
        # int4 scales (K / G, N) cannot be sliced by output channel: such a model runs per-op regions
        self.splittable = not any(lin.kind == LINEAR_KINDS["int4_native"] for layer in self._arr
                                  for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
        self._caches_key = None
        self._ws = {}  # rows -> (float32, bf16) scratch

    def set_caches(self, kv_caches) -> None:
        """Point the layers at the step's KV caches (only when they changed)."""
        key = tuple(c.data_ptr() for kv in kv_caches for c in kv)
        if key != self._caches_key:
            for dst, (k, v) in zip(self._arr, kv_caches):
                dst.k_cache, dst.v_cache = k.data_ptr(), v.data_ptr()
            self._caches_key = key

    def _workspace(self, t: int):
        if t not in self._ws:
            a, b = ctypes.c_int64(), ctypes.c_int64()
            _lib().tritium_decode_layers_workspace(t, *self.dims, ctypes.byref(a), ctypes.byref(b))
            self._ws[t] = (torch.empty(a.value, dtype=torch.float32), torch.empty(b.value, dtype=torch.bfloat16))
        return self._ws[t]

    def run(self, hidden: torch.Tensor, residual: Optional[torch.Tensor], cos: torch.Tensor, ssin: torch.Tensor,
            slots: torch.Tensor, block_tables: torch.Tensor, rows: torch.Tensor, block_size: int):
        """All layers over T rows, on torch's thread count (one parallel region where splittable).
        hidden, residual: (T, H) bfloat16 (residual None before the first layer); cos, ssin (T, D)
        bfloat16; slots (T,) int64; block_tables (B, W) int32; rows (n, 4) int64 attention rows
        (CpuAttentionPlan.rows_for). Returns the new (hidden, residual)."""
        t = hidden.shape[0]
        h = hidden.clone(memory_format=torch.contiguous_format)
        r = torch.empty_like(h) if residual is None else residual.clone(memory_format=torch.contiguous_format)
        cols = rows.t().contiguous()
        f32, b16 = self._workspace(t)
        threads = torch.get_num_threads() if self.splittable else 1
        rc = _lib().tritium_decode_layers_bf16(
            ctypes.addressof(self._arr), len(self._arr), t, *self.dims, self.eps, self.scale, self.residual_multiplier, h.data_ptr(),
            r.data_ptr(), int(residual is not None), cos.data_ptr(), ssin.data_ptr(), slots.data_ptr(),
            block_tables.data_ptr(), block_tables.shape[1], cols.data_ptr(), cols.shape[1], block_size,
            f32.data_ptr(), b16.data_ptr(), threads)
        if rc != 0:
            raise MemoryError(f"native decode step: no memory for the scratch (integer-dot activations, "
                              f"per-thread buffers) of {t} rows")
        return h, r
