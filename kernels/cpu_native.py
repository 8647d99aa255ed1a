"""Native CPU kernels, built once with the system C compiler: the int8 GEMMs (cpu_gemm.c), the
batch-invariant bfloat16 and int4 GEMMs (cpu_gemm_bf16.c), paged
decode attention over a bfloat16 KV cache (cpu_decode_attention.c), the bfloat16 element-wise
steps between a layer's GEMMs (cpu_glue.c), the multi-LoRA delta (cpu_lora.c, lora_cpu.py), and the
integer-dot LM head on int6 codes (cpu_head.c, head_pack.py).

The sources are compiled on first use for the instruction-set path this host runs best, or the
one TRITIUM_CPU_ISA forces (avx512 / avx2 / generic, kernels/cpu_isa.py), into the Tritium cache
($TRITIUM_CACHE or ~/.cache/tritium, `native/`, keyed by the sources' hash, compiler and flags) and
loaded with ctypes; they run on the OpenMP runtime torch has already loaded, so torch's thread
count applies. `isa()` names the path. Without a compiler, off Linux or with TRITIUM_NATIVE_CPU=0
`available()` is False and the layers keep torch's kernels. The references these kernels are
tested against are gemm_ref.w8a16_gemm_ref and attention_ref.paged_attention_ref.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import shutil
import subprocess
import sys
from typing import Optional

import torch

from . import cpu_isa

_HERE = os.path.dirname(os.path.abspath(__file__))
_SRCS = [os.path.join(_HERE, f) for f in ("cpu_gemm.c", "cpu_gemm_bf16.c", "cpu_gemm_w4.c", "cpu_decode_attention.c", "cpu_glue.c",
                                                 "cpu_decode_layer.c",
                                                  "cpu_gemm_i8dot.c", "cpu_i8dot_peak.c", "cpu_lora.c", "cpu_head.c",
                                                  "cpu_decode_step.c", "cpu_decode_burst.c")]
_HEADERS = [os.path.join(_HERE, h) for h in ("cpu_simd.h", "cpu_f16.h", "cpu_gemm_bf16_generic.h", "cpu_gemm_bf16_avx2.h",
                                                   "cpu_rows.h", "cpu_q8.h", "cpu_i8dot_avx2.h", "cpu_i8dot_avx512.h", "cpu_attention_tile.h", "cpu_split.h",
                                                   "cpu_step_sync.h", "cpu_step_attention.h", "cpu_step_profile.h", "cpu_step_warm.h")]
_ALIGN = 32  # K (and the int4 group size) must be a multiple of this


def _cpu_flags() -> set:
    return cpu_isa.cpu_flags()


@functools.lru_cache(maxsize=None)
def _lib() -> Optional[ctypes.CDLL]:
    if os.environ.get("TRITIUM_NATIVE_CPU", "1") in ("0", "false", "False"):
        return None
    path = cpu_isa.select()  # raises on a bad TRITIUM_CPU_ISA, whatever else holds
    if sys.platform != "linux":
        return None
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        return None
    try:
        lib = ctypes.CDLL(cpu_isa.build(cc, path, _SRCS, _HEADERS))
    except (OSError, subprocess.SubprocessError) as e:
        print(f"tritium: native CPU kernels ({path}) unavailable ({type(e).__name__}: {e}); using torch's kernels",
              file=sys.stderr)
        return None
    lib.tritium_isa = path
    i64, p = ctypes.c_int64, ctypes.c_void_p
    lib.tritium_w8a16_gemm.argtypes = [p, p, p, p, i64, i64, i64]
    lib.tritium_w8a16_gemm.restype = None
    lib.tritium_bf16_gemm.argtypes = [p, p, p, i64, i64, i64]
    lib.tritium_bf16_gemm.restype = None
    lib.tritium_bf16_gemm_bf16.argtypes = [p, p, p, i64, i64, i64]
    lib.tritium_bf16_gemm_bf16.restype = None
    lib.tritium_w4_gemm.argtypes = [p, p, p, p, p, i64, i64, i64, i64]
    lib.tritium_w4_gemm.restype = None
    lib.tritium_paged_decode_bf16.argtypes = [p, p, p, p, i64, p, p, p, p, i64, i64, i64, i64, i64,
                                              ctypes.c_float, ctypes.c_float, p]
    lib.tritium_paged_decode_bf16.restype = None
    lib.tritium_paged_decode_heads_bf16.argtypes = [p, p, p, p, i64, i64, i64, i64, i64, i64, i64, i64, i64,
                                                    ctypes.c_float, ctypes.c_float, i64, i64, p]
    lib.tritium_paged_decode_heads_bf16.restype = None
    lib.tritium_w8g_gemm.argtypes = [p, p, p, i64, p, i64, i64, i64, i64]
    lib.tritium_w8g_gemm.restype = None
    lib.tritium_i8dot_gemm.argtypes = [p, p, p, p, p, p, i64, i64, i64, i64]
    lib.tritium_i8dot_gemm.restype = ctypes.c_int
    lib.tritium_i8dot_huge_pages.argtypes = [i64]
    lib.tritium_i8dot_huge_pages.restype = None
    lib.tritium_q8_quantize.argtypes = [p, i64, i64, p, p, p]
    lib.tritium_q8_quantize.restype = None
    lib.tritium_head6_gemm.argtypes = [p, p, p, p, p, i64, i64, i64, i64]  # kernels/cpu_head.c
    lib.tritium_head6_gemm.restype = ctypes.c_int
    lib.tritium_head6_rows.argtypes = [p, p, i64, i64, p]
    lib.tritium_head6_rows.restype = None
    lib.tritium_int8g_to_bf16.argtypes = [p, p, p, i64, i64, i64, p]
    lib.tritium_int8g_to_bf16.restype = None
    lib.tritium_int8_to_bf16.argtypes = [p, i64, p]
    lib.tritium_int8_to_bf16.restype = None
    lib.tritium_int4_to_bf16.argtypes = [p, p, p, p, i64, i64, i64, p]
    lib.tritium_int4_to_bf16.restype = None
    lib.tritium_add_rms_norm_bf16.argtypes = [p, p, p, ctypes.c_float, i64, i64, p, p]
    lib.tritium_rope_kv_write_bf16.argtypes = [p, p, p, p, i64, i64, i64, i64, p, p, p]
    lib.tritium_silu_mul_bf16.argtypes = [p, i64, i64, p]
    for f in (lib.tritium_add_rms_norm_bf16, lib.tritium_rope_kv_write_bf16, lib.tritium_silu_mul_bf16):
        f.restype = None
    lib.tritium_lora_add.argtypes = [p, p, p, p, p, p, i64, i64, i64, i64, i64, i64]  # kernels/lora_cpu.py
    lib.tritium_lora_add.restype = ctypes.c_int
    return lib


def available() -> bool:
    """Whether the native kernels can run here (builds them on the first call)."""
    return _lib() is not None


def isa() -> str:
    """The path whose kernels run ("avx512", "avx2", "generic"; kernels/cpu_isa.py), or "none"
    when the native kernels are off (TRITIUM_NATIVE_CPU=0, no compiler, not Linux)."""
    lib = _lib()
    return lib.tritium_isa if lib is not None else "none"


def has_bf16_dot() -> bool:
    """Whether the path multiplies bf16 pairs in hardware (AVX512-BF16): only there are oneDNN's
    and torch's bf16 GEMMs fast; elsewhere the native GEMMs (bf16 widened to float32) take them."""
    return isa() == "avx512"


def reset() -> None:
    """Forget the loaded path so the next call selects again (tests that force TRITIUM_CPU_ISA)."""
    _lib.cache_clear()


@contextlib.contextmanager
def paths_restored():
    """For code that forces paths in turn (benchmarks): on leaving, TRITIUM_CPU_ISA is what it
    was before and the next call selects the path again."""
    saved = os.environ.get(cpu_isa.ENV)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(cpu_isa.ENV, None)
        else:
            os.environ[cpu_isa.ENV] = saved
        reset()


def use_path(path: str) -> None:
    """Force path `path` (TRITIUM_CPU_ISA) for the following calls; inside paths_restored()."""
    os.environ[cpu_isa.ENV] = path
    reset()


def supports(in_features: int) -> bool:
    """Shapes the kernel takes: K a multiple of 32."""
    return in_features % _ALIGN == 0


def _check(x: torch.Tensor, k: int) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be (M, {k}), got {tuple(x.shape)}")
    return x.to(torch.bfloat16).contiguous()


def w8a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x (M, K) @ (qweight int8 (N, K) * scales float32 (N,)[:, None])^T -> float32 (M, N)."""
    n, k = qweight.shape
    assert qweight.dtype == torch.int8 and qweight.is_contiguous() and scales.dtype == torch.float32
    assert k % _ALIGN == 0, f"w8a16_gemm: K={k} must be a multiple of {_ALIGN}"
    xb = _check(x, k)
    y = torch.empty(xb.shape[0], n, dtype=torch.float32)
    _lib().tritium_w8a16_gemm(xb.data_ptr(), qweight.data_ptr(), scales.data_ptr(), y.data_ptr(),
                              xb.shape[0], n, k)
    return y


def bf16_gemm(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x (M, K) @ weight bfloat16 (N, K)^T -> float32 (M, N), any K; each output reduced in an
    order fixed by K alone (kernels/cpu_gemm_bf16.c), so row m is the same whatever M is.
    out_dtype bfloat16: the same results rounded to bfloat16 (nearest even) by the kernel, the
    bits of .to(torch.bfloat16) on the float32 result without writing it."""
    n, k = weight.shape
    assert weight.dtype == torch.bfloat16 and weight.is_contiguous()
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"bf16_gemm: out_dtype must be float32 or bfloat16, got {out_dtype}")
    xb = _check(x, k)
    y = torch.empty(xb.shape[0], n, dtype=out_dtype)
    f = _lib().tritium_bf16_gemm if out_dtype == torch.float32 else _lib().tritium_bf16_gemm_bf16
    f(xb.data_ptr(), weight.data_ptr(), y.data_ptr(), xb.shape[0], n, k)
    return y


def _check_int4_params(scales: torch.Tensor, zeros: Optional[torch.Tensor]) -> None:
    """int4 group parameters as the kernels read them: float16 (K/G, N) as stored, zeros optional."""
    assert scales.dtype == torch.float16 and scales.is_contiguous()
    assert zeros is None or (zeros.dtype == torch.float16 and zeros.is_contiguous())


def w4_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
            group_size: int) -> torch.Tensor:
    """The int4 layout (no g_idx): x (M, K) @ int4_to_bf16(...)^T -> float32 (M, N), the same bits
    as int4_to_bf16 followed by bf16_gemm. K and G multiples of 32. zeros None: symmetric (zero 0)."""
    n, k = qweight.shape[0], 2 * qweight.shape[1]
    assert qweight.dtype == torch.uint8 and qweight.is_contiguous() and group_size % _ALIGN == 0 and k % group_size == 0
    _check_int4_params(scales, zeros)
    xb = _check(x, k)
    y = torch.empty(xb.shape[0], n, dtype=torch.float32)
    _lib().tritium_w4_gemm(xb.data_ptr(), qweight.data_ptr(), scales.data_ptr(),
                           zeros.data_ptr() if zeros is not None else None, y.data_ptr(),
                           xb.shape[0], n, k, group_size)
    return y


def q8_quantize(x: torch.Tensor):
    """The integer-dot kernels' activation quantization (kernels/cpu_gemm_i8dot.c) of x (M, K),
    K % 32 == 0, rounded to bfloat16 first: (codes int8 (M, K), scales float32 (M, K // 32),
    code sums int32 (M, K // 32))."""
    m, k = x.shape
    assert k % _ALIGN == 0
    xb = _check(x, k)
    q = torch.empty(m, k, dtype=torch.int8)
    d = torch.empty(m, k // _ALIGN, dtype=torch.float32)
    s = torch.empty(m, k // _ALIGN, dtype=torch.int32)
    _lib().tritium_q8_quantize(xb.data_ptr(), m, k, q.data_ptr(), d.data_ptr(), s.data_ptr())
    return q, d, s


def i8dot_gemm(x: torch.Tensor, w) -> torch.Tensor:
    """W8A8 / W4A8: x (M, K) @ W^T -> float32 (M, N), x quantized per row and block of 32 to int8,
    integer dot products; w an i8dot_pack.I8DotWeight (the layout and the definition are there)."""
    n, k = w.shape
    xb = _check(x, k)
    panels = (n + 15) // 16
    assert w.codes.dtype == torch.uint8 and w.codes.is_contiguous() and w.d.dtype == torch.float16
    assert w.codes.shape == (panels, k // 32, w.bits, 16, 4) and w.r.dtype == torch.float32
    assert w.d.shape == (panels, k // 32, 16) and (w.z is None or w.z.shape == w.d.shape)
    y = torch.empty(xb.shape[0], n, dtype=torch.float32)
    rc = _lib().tritium_i8dot_gemm(xb.data_ptr(), w.codes.data_ptr(), w.d.data_ptr(),
                                   w.z.data_ptr() if w.z is not None else None, w.r.data_ptr(), y.data_ptr(),
                                   xb.shape[0], n, k, w.kernel_bits)
    if rc != 0:
        raise MemoryError(f"i8dot_gemm: no memory for the quantized activations of {tuple(xb.shape)}")
    return y


def head6_gemm(x: torch.Tensor, w) -> torch.Tensor:
    """The int6 LM head, W6A8: x (M, K) @ W^T -> float32 (M, N), x quantized per row and block of
    32 to int8, integer dot products on the 6-bit codes; w a head_pack.Head6Weight."""
    n, k = w.shape
    xb = _check(x, k)
    assert w.codes.dtype == torch.uint8 and w.codes.is_contiguous() and w.codes.shape == ((n + 15) // 16, k // 32, 6, 16, 4)
    assert w.d.dtype == torch.float16 and w.d.shape == (w.codes.shape[0], k // w.group_size, 16) and w.r.dtype == torch.float32
    y = torch.empty(xb.shape[0], n, dtype=torch.float32)
    rc = _lib().tritium_head6_gemm(xb.data_ptr(), w.codes.data_ptr(), w.d.data_ptr(), w.r.data_ptr(), y.data_ptr(),
                                   xb.shape[0], n, k, w.group_size)
    if rc != 0:
        raise MemoryError(f"head6_gemm: no memory for the quantized activations of {tuple(xb.shape)}")
    return y


def head6_rows(w, ids: torch.Tensor) -> torch.Tensor:
    """The signed int8 codes (T, K) of vocabulary rows `ids` (T,) of a head_pack.Head6Weight."""
    n, k = w.shape
    ids = ids.to(torch.int64).contiguous()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n):
        raise IndexError(f"head6_rows: ids must lie in [0, {n})")
    out = torch.empty(ids.shape[0], k, dtype=torch.int8)
    _lib().tritium_head6_rows(w.codes.data_ptr(), ids.data_ptr(), ids.shape[0], k, out.data_ptr())
    return out


def pack_group_params(scales: torch.Tensor, zeros: Optional[torch.Tensor]) -> torch.Tensor:
    """scales / zeros (K // G, N) float32 of the grouped layout -> the kernel's (N, K // G, 2)
    (scale, zero) pairs, or (N, K // G, 1) scales when zeros is None: one channel's parameters
    contiguous, as w8g_gemm reads them (done once per weight, at load)."""
    parts = (scales.float().t(),) if zeros is None else (scales.float().t(), zeros.float().t())
    return torch.stack(parts, dim=-1).contiguous()


def w8g_gemm(x: torch.Tensor, qweight: torch.Tensor, params: torch.Tensor, group_size: int) -> torch.Tensor:
    """The grouped int8 layout: x (M, K) @ W^T -> float32 (M, N), W = qweight int8 (N, K) *
    scales[k // G, n] + zeros[k // G, n] rounded to bfloat16 as int8g_to_bf16 does, products summed
    in float32; params = pack_group_params(scales, zeros). K and G multiples of 32."""
    n, k = qweight.shape
    assert qweight.dtype == torch.int8 and qweight.is_contiguous() and group_size % _ALIGN == 0
    assert k % group_size == 0 and params.dtype == torch.float32 and params.is_contiguous()
    assert params.shape[:2] == (n, k // group_size) and params.shape[2] in (1, 2)
    xb = _check(x, k)
    y = torch.empty(xb.shape[0], n, dtype=torch.float32)
    _lib().tritium_w8g_gemm(xb.data_ptr(), qweight.data_ptr(), params.data_ptr(), params.shape[2], y.data_ptr(),
                            xb.shape[0], n, k, group_size)
    return y


def int8g_to_bf16(qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor], group_size: int,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The grouped int8 layout dequantized to bfloat16 (N, K): the float32 value
    q * scale + zero rounded once to nearest even. G a multiple of 32."""
    n, k = qweight.shape
    assert qweight.dtype == torch.int8 and qweight.is_contiguous() and group_size % _ALIGN == 0
    assert scales.dtype == torch.float32 and scales.is_contiguous() and scales.shape == (k // group_size, n)
    if zeros is not None:
        assert zeros.dtype == torch.float32 and zeros.is_contiguous() and zeros.shape == scales.shape
    if out is None:
        out = torch.empty(n, k, dtype=torch.bfloat16)
    assert out.shape == (n, k) and out.dtype == torch.bfloat16 and out.is_contiguous()
    _lib().tritium_int8g_to_bf16(qweight.data_ptr(), scales.data_ptr(),
                                 zeros.data_ptr() if zeros is not None else None, n, k, group_size, out.data_ptr())
    return out


def int8_to_bf16(q: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """An int8 tensor's values as bfloat16 (exact), into `out` when given (same shape)."""
    assert q.dtype == torch.int8 and q.is_contiguous()
    if out is None:
        out = torch.empty(q.shape, dtype=torch.bfloat16)
    assert out.shape == q.shape and out.dtype == torch.bfloat16 and out.is_contiguous()
    _lib().tritium_int8_to_bf16(q.data_ptr(), q.numel(), out.data_ptr())
    return out


def int4_to_bf16(qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor], group_size: int,
                 g_idx: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The int4 layout of gemm_ref.w4a16_gemm_ref dequantized to bfloat16 (N, K): the float32
    value (q - 8) * scale + zero rounded once to nearest even (zeros None: zero 0)."""
    n, k = qweight.shape[0], 2 * qweight.shape[1]
    assert qweight.dtype == torch.uint8 and qweight.is_contiguous()
    _check_int4_params(scales, zeros)
    gi = g_idx.to(torch.int32).contiguous() if g_idx is not None else None
    if out is None:
        out = torch.empty(n, k, dtype=torch.bfloat16)
    assert out.shape == (n, k) and out.dtype == torch.bfloat16 and out.is_contiguous()
    _lib().tritium_int4_to_bf16(qweight.data_ptr(), scales.data_ptr(), zeros.data_ptr() if zeros is not None else None,
                                gi.data_ptr() if gi is not None else None, n, k, group_size, out.data_ptr())
    return out


MAX_HEADS, MAX_HEADS_X_DIM = 64, 8192  # the decode kernel's MAXH and MAXQD


def decode_supported(q: torch.Tensor, k_cache: torch.Tensor, k_scale) -> bool:
    """Whether paged_decode_bf16 takes this layer: bfloat16 q and cache (no KV quantization),
    at most 64 query heads and 8192 query values per token (any head_dim)."""
    hq, d, hkv = q.shape[1], q.shape[2], k_cache.shape[2]
    return (q.dtype == torch.bfloat16 and k_cache.dtype == torch.bfloat16 and k_scale is None
            and hq <= MAX_HEADS and hq * d <= MAX_HEADS_X_DIM and hq % hkv == 0
            and q.is_contiguous() and k_cache.is_contiguous() and q.device.type == "cpu" and available())


def paged_decode_bf16(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, rows: torch.Tensor, scale: float, out: torch.Tensor,
                      softcap: Optional[float] = None) -> None:
    """Decode attention for the rows of q listed in `rows` (int64 (n, 4): token row, block-table
    row, first key position, context length), written into the same rows of out (T, Hq, D).
    softcap: scores s -> softcap * tanh(s / softcap) (None: none)."""
    assert block_tables.dtype == torch.int32 and block_tables.is_contiguous() and out.is_contiguous()
    assert rows.dtype == torch.int64 and rows.is_contiguous() and v_cache.is_contiguous()
    cols = rows.t().contiguous()
    tok, seq, lo, ln = cols[0], cols[1], cols[2], cols[3]
    _lib().tritium_paged_decode_bf16(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), block_tables.shape[1],
        tok.data_ptr(), seq.data_ptr(), lo.data_ptr(), ln.data_ptr(), rows.shape[0], q.shape[1],
        k_cache.shape[2], q.shape[2], k_cache.shape[1], float(scale), float(softcap or 0.0), out.data_ptr())


def glue_ok(x: torch.Tensor, width: int) -> bool:
    """Whether the element-wise kernels take x: bfloat16, contiguous, `width` (the vectorized
    length) a multiple of 16, and the library available. Any number of rows: a step of any size
    takes the same kernel, so a row is rounded the same way alone, in a batch or in a prefill."""
    return (x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.is_contiguous()
            and width % 16 == 0 and available())


def add_rms_norm_bf16(x: torch.Tensor, weight: torch.Tensor, eps: float, residual=None):
    """rms_norm_ref's contract for bfloat16 (T, H) rows: (normed, x + residual)."""
    t, h = x.shape
    out, res_out = torch.empty_like(x), torch.empty_like(x)
    res = residual.contiguous() if residual is not None else None
    _lib().tritium_add_rms_norm_bf16(x.data_ptr(), res.data_ptr() if res is not None else None,
                                     weight.contiguous().data_ptr(), float(eps), t, h, out.data_ptr(),
                                     res_out.data_ptr())
    return out, res_out


def rotary_kv_write_bf16(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, tables,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """RoPE on q and k of a fused qkv (T, (Hq + 2 Hkv) D) with rotary_tables' (cos, signed sin),
    k and v written to their cache slots; returns the rotated q (T, Hq, D)."""
    t = qkv.shape[0]
    cos, ssin = (c.reshape(t, head_dim).contiguous() for c in tables)
    slots = slot_mapping.to(torch.int64).contiguous()
    q = torch.empty(t, num_heads, head_dim, dtype=qkv.dtype)
    _lib().tritium_rope_kv_write_bf16(qkv.data_ptr(), cos.data_ptr(), ssin.data_ptr(), slots.data_ptr(), t,
                                      num_heads, num_kv_heads, head_dim, q.data_ptr(), k_cache.data_ptr(),
                                      v_cache.data_ptr())
    return q


def silu_mul_bf16(x: torch.Tensor) -> torch.Tensor:
    """silu_mul_ref for bfloat16 (T, 2n) rows."""
    t, n = x.shape[0], x.shape[1] // 2
    out = torch.empty(t, n, dtype=x.dtype)
    _lib().tritium_silu_mul_bf16(x.data_ptr(), t, n, out.data_ptr())
    return out
