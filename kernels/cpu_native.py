"""Native CPU GEMM for int8 weights (cpu_gemm.c), built once with the system C compiler.

On an x86 CPU with AVX512-BF16 the library is compiled on first use into the Tritium cache
($TRITIUM_CACHE or ~/.cache/tritium, `native/`, keyed by the source's hash and the compiler) and
loaded with ctypes; it runs on the OpenMP runtime torch has already loaded, so torch's thread
count applies. Anywhere else (no compiler, another CPU, TRITIUM_NATIVE_CPU=0) `available()` is
False and the quantized layers keep torch's packed kernels. The references these kernels are
tested against is gemm_ref.w8a16_gemm_ref.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Optional

import torch

_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_gemm.c")
_FLAGS = ["-O3", "-march=x86-64-v4", "-mavx512bf16", "-fopenmp", "-shared", "-fPIC"]
_ALIGN = 32  # K (and the int4 group size) must be a multiple of this


def _cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _cache_dir() -> str:
    d = os.environ.get("TRITIUM_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "tritium")
    return os.path.join(d, "native")


def _build(cc: str) -> str:
    with open(_SRC, "rb") as f:
        src = f.read()
    key = hashlib.sha256(src + " ".join([cc] + _FLAGS).encode()).hexdigest()[:16]
    out = os.path.join(_cache_dir(), f"tritium_cpu_gemm-{key}.so")
    if os.path.exists(out):
        return out
    os.makedirs(os.path.dirname(out), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(out))
    os.close(fd)
    try:
        subprocess.run([cc, *_FLAGS, _SRC, "-o", tmp], check=True, capture_output=True, timeout=120)
        os.replace(tmp, out)  # atomic: concurrent first uses never load half a file
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return out


@functools.lru_cache(maxsize=None)
def _lib() -> Optional[ctypes.CDLL]:
    if os.environ.get("TRITIUM_NATIVE_CPU", "1") in ("0", "false", "False"):
        return None
    if sys.platform != "linux" or not {"avx512f", "avx512bw", "avx512_bf16"} <= _cpu_flags():
        return None
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        return None
    try:
        lib = ctypes.CDLL(_build(cc))
    except (OSError, subprocess.SubprocessError) as e:
        print(f"tritium: native CPU GEMMs unavailable ({type(e).__name__}: {e}); using torch's kernels",
              file=sys.stderr)
        return None
    i64, p = ctypes.c_int64, ctypes.c_void_p
    lib.tritium_w8a16_gemm.argtypes = [p, p, p, p, i64, i64, i64]
    lib.tritium_w8a16_gemm.restype = None
    return lib


def available() -> bool:
    """Whether the native kernels can run here (builds them on the first call)."""
    return _lib() is not None


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
    xb = _check(x, k)
    y = torch.empty(xb.shape[0], n, dtype=torch.float32)
    _lib().tritium_w8a16_gemm(xb.data_ptr(), qweight.data_ptr(), scales.data_ptr(), y.data_ptr(),
                              xb.shape[0], n, k)
    return y
