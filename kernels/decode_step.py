"""A whole decode step in one native call (kernels/cpu_decode_step.c): the ctypes side.

`DecodeStep` wraps a model's DecodeLayers (kernels/decode_layer.py) with what the layers' caller
did in Python before: the embedding lookup (ids in; int8 / int6 codes dequantized in C), the
rotary cos / sin rows (from per-engine tables: rotary_tables of every position, the same bits as
a step's), the final RMSNorm and, for a step whose every row needs logits, the LM head as
compute_logits runs it (integer-dot, int6 or native bf16; centred where the head is) and each
row's argmax (the greedy token: first maximal index, a NaN counting as the maximum). Its scratch
is kept per row count and reused across steps; the outputs are new tensors each step. Which
models and steps take it: backend/models/native_step.py.
"""
from __future__ import annotations

import ctypes
import os
import weakref
from typing import Optional

import torch

from . import cpu_native, head_pack
from .decode_layer import DecodeLayers
from .i8dot_pack import I8DotWeight
from .rotary_ref import rotary_tables

# the EMB_* kinds of cpu_decode_step.c
EMB_NONE, EMB_BF16, EMB_I8, EMB_I8_PANELS, EMB_I6_PANELS = range(5)
SCALE_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # SCALE_* of cpu_decode_step.c
_ERRORS = {-2: "token id outside the vocabulary", -3: "position outside the rotary table (max_seq_len)",
           -5: "burst rows not a decode-only step's, or past the block tables"}


class _Front(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int64), ("vocab", ctypes.c_int64), ("group", ctypes.c_int64),
                ("w", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("scale_dtype", ctypes.c_int64),
                ("input_scale", ctypes.c_void_p),
                ("mult", ctypes.c_float), ("scaled", ctypes.c_int64), ("cos", ctypes.c_void_p),
                ("ssin", ctypes.c_void_p), ("max_pos", ctypes.c_int64), ("norm", ctypes.c_void_p)]


class _Head(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int64), ("n", ctypes.c_int64), ("param", ctypes.c_int64), ("w", ctypes.c_void_p),
                ("d", ctypes.c_void_p), ("z", ctypes.c_void_p), ("r", ctypes.c_void_p), ("in_mean", ctypes.c_void_p),
                ("out_mean", ctypes.c_void_p)]


HEAD_NONE, HEAD_I8DOT, HEAD_HEAD6, HEAD_BF16 = range(4)  # HEAD_* of cpu_decode_step.c

WARM_ENV = "TRITIUM_STEP_WARM_MIB"  # kernels/cpu_step_warm.h: MiB of the first weights warmed between steps
WARM_MAX_MIB = 64
_warm_owner = [None]  # a weak reference to the DecodeStep whose weights the warming thread reads


def warm_ranges(layers) -> list:
    """(address, bytes) of the linears' tensors of DecodeLayers `layers` in the order a step reads
    them (layer by layer: qkv, o, gate_up, down; codes or weights, then scales), up to
    WARM_MAX_MIB MiB."""
    out, total = [], 0
    for layer in layers._arr:
        for name in ("qkv", "o", "gate_up", "down"):
            lin = getattr(layer, name)
            n, k = lin.n, lin.k
            if lin.kind == 4:  # i8dot: codes (8 or 4 bits), float16 d (and z) per 32, float32 r
                parts = [(lin.w, n * k if lin.group == 8 else n * k // 2), (lin.d16, n * (k // 32) * 2),
                         (lin.z16, n * (k // 32) * 2), (lin.scale, n * 4)]
            elif lin.kind == 0:
                parts = [(lin.w, 2 * n * k)]
            elif lin.kind == 1:
                parts = [(lin.w, n * k), (lin.scale, n * 4)]
            elif lin.kind == 2:
                parts = [(lin.w, n * k), (lin.params, n * (k // lin.group) * lin.nz * 4)]
            else:  # int4: nibbles (its scales are read per group across every channel)
                parts = [(lin.w, n * k // 2)]
            for ptr, nbytes in parts:
                if ptr and nbytes > 0:
                    out.append((ptr, nbytes))
                    total += nbytes
            if total >= WARM_MAX_MIB << 20:
                return out
    return out


def _lib():
    lib = cpu_native._lib()
    if lib is not None and not hasattr(lib, "tritium_decode_step_ready"):
        p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
        lib.tritium_decode_step_bf16.argtypes = ([p, p, i64, p, p, p] + [i64] * 6 + [f32] * 3 + [p] * 6
                                                 + [i64, p, i64, i64] + [p, p, i64, p, p, p, p])
        lib.tritium_decode_step_bf16.restype = ctypes.c_int
        lib.tritium_decode_burst_bf16.argtypes = ([p, p, i64, p, p] + [i64] * 6 + [f32] * 3 + [p] * 6
                                                  + [i64, p, i64] + [p, p, i64, p, p, p] + [i64, i64, p, p, p])
        lib.tritium_decode_burst_bf16.restype = ctypes.c_int
        lib.tritium_decode_step_profile.argtypes = [p]
        lib.tritium_decode_step_profile.restype = None
        lib.tritium_step_warm_set.argtypes = [p, i64]
        lib.tritium_step_warm_set.restype = None
        lib.tritium_decode_step_ready = True
    return lib


STEP_PROFILE_OPS = ("lookup and final norm", "head")


def read_step_profile() -> dict:
    """{part: seconds} the calling thread spent in the whole-step call's lookup and rotary rows
    plus final norm, and in its LM head plus argmax, since the last read, then reset; zero unless
    TRITIUM_STEP_PROFILE is set (the layers' ops: decode_layer.read_profile)."""
    out = (ctypes.c_int64 * 2)()
    _lib().tritium_decode_step_profile(out)
    return {op: out[i] / 1e9 for i, op in enumerate(STEP_PROFILE_OPS)}


def embedding_source(weight: Optional[torch.Tensor], quant) -> Optional[tuple]:
    """(kind, vocab, group, codes or rows, scales or None) of the lookup table: a
    bfloat16 `weight` (V, H), or a quantized embedding module `quant` (backend/quant.py Int8Linear /
    Int6Linear) whose codes are plain int8 rows or the head's integer-dot / int6 panels; None
    where the C lookup does not read it (int4, packed int6 rows, other dtypes)."""
    if quant is None:
        if weight is None or weight.dtype != torch.bfloat16 or not weight.is_contiguous():
            return None
        return EMB_BF16, weight.shape[0], 0, weight, None
    scales = getattr(quant, "scales", None)
    if getattr(quant, "method", None) not in ("int8", "int6") or scales is None or scales.dtype not in SCALE_DTYPES:
        return None
    panels, group = getattr(quant, "_panels", None), quant.group_size or 0
    if panels is not None:
        kind = EMB_I6_PANELS if isinstance(panels, head_pack.Head6Weight) else \
            EMB_I8_PANELS if isinstance(panels, I8DotWeight) and panels.bits == 8 else None
        if kind is None or not panels.codes.is_contiguous():
            return None
        return kind, panels.shape[0], group, panels.codes, quant.scales.contiguous()
    q = quant.qweight
    if q.dtype != torch.int8 or q.dim() != 2 or q.shape[0] != quant.out_features or not q.is_contiguous():
        return None
    return EMB_I8, q.shape[0], group, q, quant.scales.contiguous()


def head_source(packed, bias, in_mean: Optional[torch.Tensor], out_mean: Optional[torch.Tensor]) -> Optional[tuple]:
    """(kind, n, param, (w, d, z, r), in_mean, out_mean) of an LM head whose packed weight (a
    CpuLinear) the call runs as compute_logits does: the integer-dot head (i8dot_pack.I8DotWeight),
    the int6 head (head_pack.Head6Weight) or the native bf16 GEMM, no bias; None otherwise."""
    if packed is None or bias is not None or packed.perm is not None:
        return None
    if packed.kind == "i8dot":
        q = packed.tensors[0]
        return HEAD_I8DOT, q.shape[0], q.kernel_bits, (q.codes, q.d, q.z, q.r), in_mean, out_mean
    if packed.kind == "head6":
        q = packed.tensors[0]
        return HEAD_HEAD6, q.shape[0], q.group_size, (q.codes, q.d, None, q.r), in_mean, out_mean
    if packed.kind == "bf16_native":
        w = packed.tensors[0]
        return HEAD_BF16, w.shape[0], 0, (w, None, None, None), in_mean, out_mean
    return None


class DecodeStep:
    """layers: the model's DecodeLayers; cos_sin_cache (max_pos, D) float32 [cos | sin] (the
    model's global table); norm (H,) bf16; eps; embedding multiplier (1.0: none)."""

    def __init__(self, layers: DecodeLayers, cos_sin_cache: torch.Tensor, norm: torch.Tensor, multiplier: float):
        self.layers = layers
        self.h, _, _, self.d, _ = layers.dims
        cos, ssin = rotary_tables(torch.arange(cos_sin_cache.shape[0]), cos_sin_cache, torch.bfloat16)
        self._cos, self._ssin = cos.reshape(-1, self.d).contiguous(), ssin.reshape(-1, self.d).contiguous()
        self._norm = norm.contiguous()
        self.front = _Front(cos=self._cos.data_ptr(), ssin=self._ssin.data_ptr(), max_pos=self._cos.shape[0],
                            norm=self._norm.data_ptr())
        if multiplier != 1.0:  # rounded to bf16 first, as decoder._scale_embedding does
            self.front.mult, self.front.scaled = float(torch.tensor(multiplier, dtype=torch.bfloat16)), 1
        self._emb_key, self._emb_keep = None, None
        self.head, self._head_key, self._head_keep = None, None, None
        self._scratch = {}

    def set_embedding(self, source: Optional[tuple], input_scale: Optional[torch.Tensor]) -> None:
        """Point the lookup at `source` (embedding_source; None: the caller embeds)."""
        key = None if source is None else (source[3].data_ptr(), None if source[4] is None else source[4].data_ptr(),
                                           None if input_scale is None else input_scale.data_ptr())
        if key == self._emb_key and (source is None) == (self.front.kind == EMB_NONE):
            return
        f = self.front
        if source is None:
            f.kind, self._emb_keep = EMB_NONE, None
        else:
            kind, vocab, group, w, scales = source
            inp = None if input_scale is None else input_scale.float().contiguous()
            self._emb_keep = (w, scales, inp)
            f.kind, f.vocab, f.group, f.w = kind, vocab, group, w.data_ptr()
            f.scale = None if scales is None else scales.data_ptr()
            f.scale_dtype = 0 if scales is None else SCALE_DTYPES[scales.dtype]
            f.input_scale = None if inp is None else inp.data_ptr()
        self._emb_key = key

    def set_head(self, source: Optional[tuple]) -> None:
        """Point the call's LM head at `source` (head_source; None: the caller runs the head)."""
        key = None if source is None else tuple(None if t is None else t.data_ptr()
                                                 for t in source[3] + source[4:]) + source[:3]
        if key == self._head_key:
            return
        if source is None:
            self.head, self._head_keep = None, None
        else:
            kind, n, param, tensors, in_mean, out_mean = source
            in_mean = None if in_mean is None else in_mean.float().contiguous()
            out_mean = None if out_mean is None else out_mean.float().contiguous()
            self._head_keep = tensors + (in_mean, out_mean)
            ptr = [None if t is None else t.data_ptr() for t in self._head_keep]
            self.head = _Head(kind, n, param, *ptr)
        self._head_key = key

    def _bufs(self, t: int):
        """Per row count: the scratch tensors and the call's arguments that depend only on T (the
        scratch and workspace pointers), built once."""
        if t not in self._scratch:
            e = torch.empty
            bufs = (e(t, self.h, dtype=torch.bfloat16), e(t, self.h, dtype=torch.bfloat16),
                    e(t, self.d, dtype=torch.bfloat16), e(t, self.d, dtype=torch.bfloat16))
            normed = e(t, self.h, dtype=torch.bfloat16)  # the final norm's output where the head runs (not returned)
            lay = self.layers
            f32, b16 = lay._workspace(t)
            mid = (t, *lay.dims, lay.eps, lay.scale, lay.residual_multiplier) + tuple(b.data_ptr() for b in bufs)
            self._scratch[t] = (bufs + (normed,), mid, (f32.data_ptr(), b16.data_ptr()), normed.data_ptr())
        return self._scratch[t]

    def _check(self, rc: int, t: int) -> None:
        if rc == -1:
            raise MemoryError(f"native decode step: no memory for the scratch of {t} rows")
        if rc == -4:
            raise ValueError(f"{WARM_ENV} must be an integer in [0, {WARM_MAX_MIB}] (MiB), got "
                             f"{os.environ.get(WARM_ENV)!r}")
        if rc in _ERRORS:
            raise IndexError(f"native decode step: {_ERRORS[rc]}")

    def _own_warming(self) -> None:
        if _warm_owner[0] is None or _warm_owner[0]() is not self:  # the warming thread reads these weights
            flat = [v for pair in warm_ranges(self.layers) for v in pair]
            _lib().tritium_step_warm_set((ctypes.c_int64 * max(1, len(flat)))(*flat), len(flat) // 2)
            _warm_owner[0] = weakref.ref(self)

    def run_burst(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
                  rows: torch.Tensor, block_size: int, k: int, window: Optional[int], stop_ids: list) -> list:
        """Up to k greedy decode steps in one call (kernels/cpu_decode_burst.c): ids, positions,
        slots (T,) int64 and rows (T, 4) of the first step as run() takes them (a decode-only step:
        row t reads block-table row t, whose blocks must cover positions + k - 1); window: the
        sliding window or None; stop_ids: T lists of each row's stop ids (EOS, stop token ids). The
        head and the lookup must be the call's own. Returns the steps' tokens, a list of lists
        (steps run, T): it stops after the step where a row produced one of its stop ids."""
        t = positions.shape[0]
        assert self.head is not None and self.front.kind != EMB_NONE
        _, mid, ws, normed = self._bufs(t)
        cols = rows.t().contiguous()
        y, out = torch.empty(t, self.head.n, dtype=torch.float32), torch.empty(k, t, dtype=torch.int64)
        flat = [s for row in stop_ids for s in row]
        off = [0]
        for row in stop_ids:
            off.append(off[-1] + len(row))
        stops = (ctypes.c_int64 * max(1, len(flat)))(*flat)
        stop_off = (ctypes.c_int64 * (t + 1))(*off)
        lay = self.layers
        threads = torch.get_num_threads() if lay.splittable else 1
        self._own_warming()
        rc = _lib().tritium_decode_burst_bf16(
            ctypes.addressof(self.front), ctypes.addressof(lay._arr), len(lay._arr), ids.data_ptr(),
            positions.data_ptr(), *mid, slots.data_ptr(), block_tables.data_ptr(), block_tables.shape[1],
            cols.data_ptr(), block_size, *ws, threads, normed, ctypes.addressof(self.head), y.data_ptr(),
            k, window or 0, stops, stop_off, out.data_ptr())
        if rc < 0:
            self._check(rc, t)
        return out[:rc].tolist()

    def run(self, ids: torch.Tensor, positions: torch.Tensor, hidden: Optional[torch.Tensor], slots: torch.Tensor,
            block_tables: torch.Tensor, rows: torch.Tensor, block_size: int, logits: bool = False):
        """T rows: ids, positions (T,) int64 (hidden (T, H) bf16 the embedded rows where the
        lookup is the caller's); slots, block_tables, rows as DecodeLayers.run takes them. Returns
        the final norm's output (T, H) bf16; with `logits` (and a head set), (float32 logits
        (T, vocab), every row's argmax as a list) instead."""
        t = positions.shape[0]
        _, mid, ws, normed = self._bufs(t)
        cols = rows.t().contiguous()
        lay = self.layers
        head = self.head if logits else None
        if head is not None:
            out = None
            y, tokens = torch.empty(t, head.n, dtype=torch.float32), torch.empty(t, dtype=torch.int64)
            tail = (normed, ctypes.addressof(head), y.data_ptr(), tokens.data_ptr())
        else:
            out = torch.empty(t, self.h, dtype=torch.bfloat16)
            tail = (out.data_ptr(), None, None, None)
        threads = torch.get_num_threads() if lay.splittable else 1
        self._own_warming()
        rc = _lib().tritium_decode_step_bf16(
            ctypes.addressof(self.front), ctypes.addressof(lay._arr), len(lay._arr), ids.data_ptr(),
            positions.data_ptr(), None if hidden is None else hidden.data_ptr(), *mid, slots.data_ptr(),
            block_tables.data_ptr(), block_tables.shape[1], cols.data_ptr(), cols.shape[1], block_size,
            *ws, threads, *tail)
        self._check(rc, t)
        return out if head is None else (y, tokens.tolist())
