"""Run the native CPU kernels on a forced ISA path (docs: ISA convention in kernels/cpu_native.py).

isa_kernels(path) gives cpu_native's wrappers bound to that path's library: the same C sources
compiled with the path's flags (avx512: x86-64-v4 + VNNI, avx2: x86-64-v3, generic: the
compiler's default target), so each path runs on any x86 host that can run it.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import subprocess
import tempfile

import pytest

from tritium.kernels import cpu_native

PATHS = ("avx512", "avx2", "generic")
_PATH_FLAGS = {"avx512": ["-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"], "avx2": ["-march=x86-64-v3"],
               "generic": []}
_NEEDS = {"avx512": {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}, "avx2": {"avx2", "fma", "f16c"},
          "generic": set()}
_SRC = os.path.join(os.path.dirname(cpu_native.__file__), "cpu_gemm_i8dot.c")


@functools.lru_cache(maxsize=None)
def _path_lib(path: str):
    missing = _NEEDS[path] - cpu_native._cpu_flags()
    if missing:
        pytest.fail(f"ISA path {path} cannot run on this host (missing {sorted(missing)}); "
                    f"a test must choose among the host's paths")
    with open(_SRC, "rb") as f:
        key = hashlib.sha256(f.read() + " ".join(_PATH_FLAGS[path]).encode()).hexdigest()[:12]
    out = os.path.join(tempfile.gettempdir(), f"tritium_i8dot_{path}_{key}_{os.getpid()}.so")
    subprocess.run(["gcc", "-O3", *_PATH_FLAGS[path], "-fopenmp", "-shared", "-fPIC", _SRC, "-lm", "-o", out],
                   check=True, capture_output=True, timeout=120)
    lib = ctypes.CDLL(out)
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.tritium_i8dot_gemm.argtypes = [p, p, p, p, p, p, i64, i64, i64, i64]
    lib.tritium_i8dot_gemm.restype = ctypes.c_int
    lib.tritium_q8_quantize.argtypes = [p, i64, i64, p, p, p]
    lib.tritium_q8_quantize.restype = None
    return lib


class _Bound:
    def __init__(self, path: str):
        self.path, self._lib = path, _path_lib(path)

    @contextlib.contextmanager
    def _bound(self):
        real = cpu_native._lib
        cpu_native._lib = lambda: self._lib
        try:
            yield
        finally:
            cpu_native._lib = real

    def q8_quantize(self, x):
        with self._bound():
            return cpu_native.q8_quantize(x)

    def i8dot_gemm(self, x, w):
        with self._bound():
            return cpu_native.i8dot_gemm(x, w)


def isa_kernels(path: str) -> _Bound:
    return _Bound(path)
