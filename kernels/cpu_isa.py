"""Which native CPU path runs here, and its build: the same C sources (kernels/cpu_*.c) compiled once
per instruction-set path into its own shared library (docs/cpu_kernels.md).

Paths, best first: `avx512` (x86 with AVX-512 F/BW/VL, AVX512-BF16 and VNNI), `avx2` (x86-64-v3:
AVX2, FMA, F16C, BMI1/2), `generic` (portable C the compiler vectorizes for its default target: the
only path on Arm and other CPUs). Unset, TRITIUM_CPU_ISA picks the best path the host runs;
set, it forces one (a path this host cannot run, or an unknown name, is an error naming the variable
and the allowed values). Inside a source, `#if defined(__AVX512F__) && defined(__AVX512BF16__)` /
`#elif defined(__AVX2__) && defined(__FMA__)` / `#else` select the code; every library exports the
same symbols.
"""
from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sys
import tempfile
from typing import List, Sequence

PATHS = ("avx512", "avx2", "generic")  # best first
ENV = "TRITIUM_CPU_ISA"
_COMMON = ["-O3", "-fopenmp", "-shared", "-fPIC"]
# avx2 / generic: no contraction of a * b + c into FMA behind the code's back, so a kernel's
# rounding is what its source says on every compiler target (explicit FMAs stay FMAs)
FLAGS = {
    "avx512": ["-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"],
    "avx2": ["-march=x86-64-v3", "-ffp-contract=off"],
    "generic": ["-ffp-contract=off"],
}
# /proc/cpuinfo flags each x86 path needs (x86-64-v4 / v3 plus what the sources use)
NEEDS = {
    "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512cd", "avx512dq", "avx512_bf16", "avx512_vnni",
               "avx2", "fma", "f16c", "bmi1", "bmi2"},
    "avx2": {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"},
    "generic": set(),
}


def cpu_flags() -> set:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def runnable(flags=None) -> List[str]:
    """The paths this host can run, best first (generic always; x86 paths from the CPU flags)."""
    if not is_x86():
        return ["generic"]
    flags = cpu_flags() if flags is None else flags
    return [p for p in PATHS if NEEDS[p] <= flags]


def select(env=None, flags=None) -> str:
    """The path to use: TRITIUM_CPU_ISA when set (checked), else the best runnable one."""
    env = os.environ if env is None else env
    can = runnable(flags)
    want = env.get(ENV, "").strip().lower()
    if not want:
        return can[0]
    if want not in PATHS:
        raise ValueError(f"{ENV}={env.get(ENV)!r} is not a CPU path; allowed values: {', '.join(PATHS)}")
    if want not in can:
        missing = sorted(NEEDS[want] - (cpu_flags() if flags is None else flags)) if is_x86() else []
        why = f"missing CPU flags {', '.join(missing)}" if missing else f"{platform.machine()} is not x86-64"
        raise ValueError(f"{ENV}={want} cannot run on this CPU ({why}); allowed values here: {', '.join(can)}")
    return want


def cache_dir() -> str:
    d = os.environ.get("TRITIUM_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "tritium")
    return os.path.join(d, "native")


def build(cc: str, isa: str, srcs: Sequence[str], headers: Sequence[str]) -> str:
    """Compile srcs for one path (cached by sources, compiler and flags); returns the .so path."""
    flags = _COMMON + FLAGS[isa]
    src = b""
    for path in list(srcs) + list(headers):
        with open(path, "rb") as f:
            src += f.read()
    key = hashlib.sha256(src + " ".join([cc] + flags).encode()).hexdigest()[:16]
    out = os.path.join(cache_dir(), f"tritium_cpu-{isa}-{key}.so")
    if os.path.exists(out):
        return out
    os.makedirs(os.path.dirname(out), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(out))
    os.close(fd)
    try:
        r = subprocess.run([cc, *flags, *srcs, "-lm", "-o", tmp], capture_output=True, timeout=300)
        if r.returncode != 0:
            raise subprocess.SubprocessError(f"{cc} failed for the {isa} path: "
                                             f"{r.stderr.decode(errors='replace')[-2000:]}")
        os.replace(tmp, out)  # atomic: concurrent first uses never load half a file
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return out


def describe() -> str:
    """One line for logs: the path chosen and why it is the one."""
    forced = os.environ.get(ENV, "").strip()
    return f"{select()} ({'forced by ' + ENV if forced else 'best of ' + ', '.join(runnable())})"


if __name__ == "__main__":  # python -m tritium.kernels.cpu_isa: print the path taken
    print(describe(), file=sys.stdout)
