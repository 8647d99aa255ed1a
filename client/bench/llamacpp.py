"""llama.cpp for the side-by-side benchmark: build llama-server from the llama-cpp-python sdist,
requantize a GGUF with llama-quantize, and run llama-server as a child process.

Build (once, cached in <tritium cache>/llama.cpp/, about 10 minutes on 2 cores):
    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36; untar; in vendor/llama.cpp:
    cmake -B build -G Ninja -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON -DCMAKE_BUILD_TYPE=Release
    cmake --build build --target llama-server llama-quantize -j N
An existing build is used instead when --llama-cpp-dir (or $TRITIUM_LLAMA_CPP_DIR) names its
llama.cpp folder (the one holding build/bin/llama-server).

A forced instruction set (`tritium compare --isa avx2|avx512|generic`) builds into build-<isa>/
of the same source with GGML_NATIVE=OFF and ggml's x86 options set for that ISA (cmake_flags), so
an AVX2 llama.cpp can be measured on an AVX-512 host beside Tritium's forced avx2 path.
"""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from typing import List, Optional

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
ENV_DIR = "TRITIUM_LLAMA_CPP_DIR"
_COMMON = ["-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DCMAKE_BUILD_TYPE=Release"]
CMAKE_FLAGS = ["-DGGML_NATIVE=ON", *_COMMON]
ISAS = ("native", "avx512", "avx2", "generic")
# ggml's x86 options (ggml/CMakeLists.txt) and the ones each forced ISA turns on; the rest are OFF
_X86_OPTIONS = ("SSE42", "AVX", "AVX2", "BMI2", "FMA", "F16C", "AVX_VNNI", "AVX512", "AVX512_VBMI",
                "AVX512_VNNI", "AVX512_BF16")
_ISA_ON = {"avx2": {"SSE42", "AVX", "AVX2", "BMI2", "FMA", "F16C"},
           "avx512": {"SSE42", "AVX", "AVX2", "BMI2", "FMA", "F16C", "AVX512", "AVX512_VBMI", "AVX512_VNNI",
                      "AVX512_BF16"},
           "generic": set()}


def check_isa(isa: str) -> str:
    if isa not in ISAS:
        raise ValueError(f"--isa must be one of {', '.join(ISAS)}, got {isa!r}")
    return isa


def cmake_flags(isa: str = "native") -> List[str]:
    """cmake options for llama.cpp built for `isa`: GGML_NATIVE=ON for native, else GGML_NATIVE=OFF
    with exactly that ISA's x86 options on (AVX2: AVX, AVX2, FMA, F16C, BMI2; AVX-512 adds
    AVX512F, VBMI, VNNI, BF16; generic: none)."""
    if check_isa(isa) == "native":
        return list(CMAKE_FLAGS)
    return (["-DGGML_NATIVE=OFF"] + [f"-DGGML_{o}={'ON' if o in _ISA_ON[isa] else 'OFF'}" for o in _X86_OPTIONS]
            + _COMMON)


def build_dir(isa: str = "native") -> str:
    return "build" if check_isa(isa) == "native" else f"build-{isa}"


def binary(src_dir: str, name: str, isa: str = "native") -> str:
    return os.path.join(src_dir, build_dir(isa), "bin", name)


def has_build(src_dir: str, isa: str = "native") -> bool:
    return all(os.access(binary(src_dir, b, isa), os.X_OK) for b in ("llama-server", "llama-quantize"))


def ensure_llama_cpp(src_dir: Optional[str] = None, jobs: int = 2, log=print, isa: str = "native") -> str:
    """The llama.cpp folder holding <build>/bin/llama-server and llama-quantize (build/ for the native
    build, build-<isa>/ for a forced ISA); builds it when needed.

    src_dir (--llama-cpp-dir, else $TRITIUM_LLAMA_CPP_DIR) must already hold that build; without it
    the build cached in the Tritium cache is used, and made (download + cmake) the first time.
    """
    given = src_dir or os.environ.get(ENV_DIR)
    if given:
        if not has_build(given, isa):
            how = "" if isa == "native" else (f"; for --isa {isa} build it there with: cmake -B {build_dir(isa)} "
                                              f"{' '.join(cmake_flags(isa))}")
            raise ValueError(f"--llama-cpp-dir / ${ENV_DIR} {given}: no {build_dir(isa)}/bin/llama-server and "
                             f"llama-quantize there (give the vendor/llama.cpp folder of a built llama-cpp-python "
                             f"sdist{how})")
        return given
    from tritium.client.serve.server import cache_dir
    work = os.path.join(cache_dir(), "llama.cpp")
    found = glob.glob(os.path.join(work, "llama_cpp_python-*", "vendor", "llama.cpp"))
    if found and has_build(found[0], isa):
        return found[0]
    log_file = os.path.join(work, "build.log" if isa == "native" else f"build-{isa}.log")
    log(f"building llama-server ({isa}) from the {LLAMA_CPP_PYTHON} sdist into {work} (about 10 minutes on 2 "
        f"cores; log: {log_file}) ...")
    src = llama_cpp_source()
    bdir = build_dir(isa)
    with open(log_file, "ab") as fh:
        gen = ["-G", "Ninja"] if shutil.which("ninja") else []
        _run(["cmake", "-B", bdir, *gen, *cmake_flags(isa)], fh, "cmake configure", cwd=src)
        _run(["cmake", "--build", bdir, "--target", "llama-server", "llama-quantize", "-j", str(jobs)], fh,
             "cmake build", cwd=src)
    if not has_build(src, isa):
        raise OSError(f"llama.cpp build finished without llama-server / llama-quantize (log: {log_file})")
    return src


def llama_cpp_source() -> str:
    """The vendor/llama.cpp folder of the llama-cpp-python sdist, downloaded (pip, once) and
    unpacked into <tritium cache>/llama.cpp/; holds convert_hf_to_gguf.py and its gguf-py."""
    from tritium.client.serve.server import cache_dir
    work = os.path.join(cache_dir(), "llama.cpp")
    found = glob.glob(os.path.join(work, "llama_cpp_python-*", "vendor", "llama.cpp", "convert_hf_to_gguf.py"))
    if found:
        return os.path.dirname(found[0])
    os.makedirs(work, exist_ok=True)
    with open(os.path.join(work, "download.log"), "ab") as fh:
        sdists = glob.glob(os.path.join(work, "llama_cpp_python-*.tar.gz"))
        if not sdists:
            _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", LLAMA_CPP_PYTHON,
                  "-d", work], fh, "pip download")
            sdists = glob.glob(os.path.join(work, "llama_cpp_python-*.tar.gz"))
        if not sdists:
            raise OSError(f"pip download of {LLAMA_CPP_PYTHON} left no sdist in {work} (log: {fh.name})")
    tmp = tempfile.mkdtemp(prefix=".unpack-", dir=work)  # unpack aside, then move: concurrent callers
    try:
        with tarfile.open(sdists[0]) as tar:
            try:
                tar.extractall(tmp, filter="data")
            except TypeError:  # Python without extraction filters (< 3.10.12)
                tar.extractall(tmp)
        for name in os.listdir(tmp):
            if not os.path.exists(os.path.join(work, name)):
                os.replace(os.path.join(tmp, name), os.path.join(work, name))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return glob.glob(os.path.join(work, "llama_cpp_python-*", "vendor", "llama.cpp"))[0]


def _run(cmd: List[str], log_fh, what: str, cwd: Optional[str] = None) -> None:
    log_fh.write(f"$ {' '.join(cmd)}\n".encode())
    log_fh.flush()
    if subprocess.call(cmd, stdout=log_fh, stderr=subprocess.STDOUT, cwd=cwd) != 0:
        raise OSError(f"{what} failed: {' '.join(cmd)} (log: {log_fh.name})")


def requantize(src_dir: str, gguf: str, qtype: str, out_dir: str, isa: str = "native") -> str:
    """GGUF `gguf` requantized to qtype (BF16, Q8_0, Q4_0, ...) in out_dir (cached); returns its path."""
    base = os.path.splitext(os.path.basename(gguf))[0].rsplit(".", 1)[0]
    out = os.path.join(out_dir, f"{base}.{qtype}.gguf")
    if os.path.isfile(out):
        return out
    os.makedirs(out_dir, exist_ok=True)
    tmp = out + ".partial"
    with open(out + ".log", "wb") as fh:
        _run([binary(src_dir, "llama-quantize", isa), "--allow-requantize", gguf, tmp, qtype], fh, "llama-quantize")
    os.replace(tmp, out)
    return out


class LlamaServer:
    """llama-server on a free loopback port; stop() always reaps it (SIGINT, then SIGKILL)."""

    def __init__(self, src_dir: str, model: str, parallel: int = 16, ctx_per_slot: int = 2048, threads: int = 2,
                 log_file: Optional[str] = None, port: Optional[int] = None, extra_args: Optional[List[str]] = None,
                 isa: str = "native", api_key: Optional[str] = None):
        from tritium.client.serve.server import free_port
        self.api_key = api_key  # given to llama-server as $LLAMA_API_KEY (not on its command line)
        self.port = port or free_port()
        self.cmd = [binary(src_dir, "llama-server", isa), "-m", model, "--host", "127.0.0.1", "--port", str(self.port),
                    "-np", str(parallel), "-c", str(parallel * ctx_per_slot), "-t", str(threads),
                    "-tb", str(threads), "--no-webui", *(extra_args or [])]
        self.log_file = log_file
        self.proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 300.0) -> "LlamaServer":
        out = open(self.log_file, "ab") if self.log_file else subprocess.DEVNULL
        try:
            env = dict(os.environ, LLAMA_API_KEY=self.api_key) if self.api_key else None
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                         env=env)
        finally:
            if out is not subprocess.DEVNULL:
                out.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise OSError(f"llama-server exited with code {self.proc.returncode} before it was ready "
                              f"(log: {self.log_file})")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.25)
        self.stop()
        raise OSError(f"llama-server not ready after {timeout:.0f} s (log: {self.log_file})")

    def stop(self) -> Optional[int]:
        if self.proc is None:
            return None
        from tritium.client.serve.server import stop_process_group
        return stop_process_group(self.proc, 15)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
