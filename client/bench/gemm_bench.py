"""The bf16 GEMM at prompt-sized row counts against the core's peak and torch / oneDNN: a benchmark
that prints figures.

    python -m tritium.client.bench.gemm_bench [--paths avx512 avx2] [--rows 64 256 512] [--rounds 5]
        [--base-kernels DIR]

For SmolLM2-135M's linears (q / o 576x576, k / v 192x576, fused gate_up 3072x576, down 576x1536;
N x K) and each row count, prints GFLOP/s (2 M N K flops per call) of tritium_bf16_gemm
(kernels/cpu_gemm_bf16.c) on each native path, torch's bf16 linear and oneDNN's bf16 GEMM on a
pre-packed weight (what kernels/cpu_linear.py packs with TRITIUM_CPU_ONEDNN=1) on the same inputs,
and the peak of the instruction each path is built on, measured on this core by a loop of
independent accumulators: VDPBF16PS (32 bf16 products per zmm; avx512) and 256-bit FMA (avx2).
One thread. Each figure is the best of --rounds, every round timing every kernel in turn (on a
shared host the best round is the one least disturbed), each time the CPU time of the calling
thread (time.thread_time: waiting for a core does not count). With ONEDNN_MAX_CPU_ISA=AVX2 in the
environment torch and oneDNN run what they have for an AVX2 CPU.

--base-kernels DIR: also time the GEMM compiled from DIR (another revision's kernels/*.c, *.h,
e.g. `git archive main kernels | tar -x -C /tmp/base`), in the same rounds (column `PATH base`).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import tempfile
import time
from typing import Callable, Dict, List, Tuple

import torch

from tritium.kernels import cpu_isa, cpu_linear, cpu_native

SHAPES = ((576, 576), (192, 576), (3072, 576), (576, 1536))  # (N, K)
_PEAK_SRC = r"""
#include <immintrin.h>
#include <stdint.h>
#define A(i) a##i
#if defined(__AVX512BF16__)
/* n steps of 24 independent VDPBF16PS chains: 24 * 32 * 2 flops a step */
float peak_dp(int64_t n) {
    __m512 A(0) = _mm512_set1_ps(0.f), A(1) = _mm512_set1_ps(1.f), A(2) = _mm512_set1_ps(2.f), A(3) = _mm512_set1_ps(3.f),
           A(4) = _mm512_set1_ps(4.f), A(5) = _mm512_set1_ps(5.f), A(6) = _mm512_set1_ps(6.f), A(7) = _mm512_set1_ps(7.f),
           A(8) = _mm512_set1_ps(8.f), A(9) = _mm512_set1_ps(9.f), A(10) = _mm512_set1_ps(10.f), A(11) = _mm512_set1_ps(11.f),
           A(12) = _mm512_set1_ps(12.f), A(13) = _mm512_set1_ps(13.f), A(14) = _mm512_set1_ps(14.f), A(15) = _mm512_set1_ps(15.f),
           A(16) = _mm512_set1_ps(16.f), A(17) = _mm512_set1_ps(17.f), A(18) = _mm512_set1_ps(18.f), A(19) = _mm512_set1_ps(19.f),
           A(20) = _mm512_set1_ps(20.f), A(21) = _mm512_set1_ps(21.f), A(22) = _mm512_set1_ps(22.f), A(23) = _mm512_set1_ps(23.f);
    __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80), w = x;
#define D(i) A(i) = _mm512_dpbf16_ps(A(i), x, w);
    for (int64_t j = 0; j < n; j++) {
        D(0) D(1) D(2) D(3) D(4) D(5) D(6) D(7) D(8) D(9) D(10) D(11)
        D(12) D(13) D(14) D(15) D(16) D(17) D(18) D(19) D(20) D(21) D(22) D(23)
        __asm__ volatile("" : "+v"(x), "+v"(w));
    }
    __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(A(0), A(1)), _mm512_add_ps(A(2), A(3))),
                             _mm512_add_ps(_mm512_add_ps(A(4), A(5)), _mm512_add_ps(A(6), A(7))));
    s = _mm512_add_ps(s, _mm512_add_ps(_mm512_add_ps(A(8), A(9)), _mm512_add_ps(A(10), A(11))));
    s = _mm512_add_ps(s, _mm512_add_ps(_mm512_add_ps(A(12), A(13)), _mm512_add_ps(A(14), A(15))));
    s = _mm512_add_ps(s, _mm512_add_ps(_mm512_add_ps(A(16), A(17)), _mm512_add_ps(A(18), A(19))));
    s = _mm512_add_ps(s, _mm512_add_ps(_mm512_add_ps(A(20), A(21)), _mm512_add_ps(A(22), A(23))));
    return _mm512_reduce_add_ps(s);
}
#endif
#if defined(__FMA__)
/* n steps of 12 independent 256-bit FMA chains: 12 * 8 * 2 flops a step */
float peak_fma(int64_t n) {
    __m256 A(0) = _mm256_set1_ps(0.f), A(1) = _mm256_set1_ps(1.f), A(2) = _mm256_set1_ps(2.f), A(3) = _mm256_set1_ps(3.f),
           A(4) = _mm256_set1_ps(4.f), A(5) = _mm256_set1_ps(5.f), A(6) = _mm256_set1_ps(6.f), A(7) = _mm256_set1_ps(7.f),
           A(8) = _mm256_set1_ps(8.f), A(9) = _mm256_set1_ps(9.f), A(10) = _mm256_set1_ps(10.f), A(11) = _mm256_set1_ps(11.f);
    __m256 x = _mm256_set1_ps(1.0f), w = x;
#define F(i) A(i) = _mm256_fmadd_ps(x, w, A(i));
    for (int64_t j = 0; j < n; j++) {
        F(0) F(1) F(2) F(3) F(4) F(5) F(6) F(7) F(8) F(9) F(10) F(11)
        __asm__ volatile("" : "+x"(x), "+x"(w));
    }
    __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(A(0), A(1)), _mm256_add_ps(A(2), A(3))),
                             _mm256_add_ps(_mm256_add_ps(A(4), A(5)), _mm256_add_ps(A(6), A(7))));
    s = _mm256_add_ps(s, _mm256_add_ps(_mm256_add_ps(A(8), A(9)), _mm256_add_ps(A(10), A(11))));
    return s[0];
}
#endif
"""
_PEAK = {"avx512": ("peak_dp", 24 * 32 * 2), "avx2": ("peak_fma", 12 * 8 * 2)}


def _cpu_s(fn: Callable[[], object], calls: int = 2) -> float:
    t0 = time.thread_time()
    for _ in range(calls):
        fn()
    return (time.thread_time() - t0) / calls


def _peak_fn(path: str) -> Callable[[], float]:
    """GFLOP/s of the path's peak loop (one measurement)."""
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    with tempfile.NamedTemporaryFile("w", suffix=".c", delete=False) as f:
        f.write(_PEAK_SRC)
    try:
        lib = ctypes.CDLL(cpu_isa.build(cc, path, [f.name], []))
    finally:
        os.unlink(f.name)
    name, flops = _PEAK[path]
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = [ctypes.c_int64], ctypes.c_float
    steps = 2_000_000
    return lambda: flops * steps / _cpu_s(lambda: fn(steps), 1) / 1e9


def _gemm_lib(path: str, base_dir: str = None):
    cpu_native.use_path(path)
    if base_dir is None:
        return cpu_native._lib()
    from tritium.client.bench.workload_profile import base_lib
    return base_lib(base_dir)


def run(paths: List[str], rows: List[int], rounds: int, base_dir: str = None) -> Tuple[Dict, Dict]:
    """({(M, N, K): {column: best GFLOP/s}}, {path: peak GFLOP/s})."""
    libs = {}
    with cpu_native.paths_restored():
        for p in paths:
            libs[p] = _gemm_lib(p)
            if base_dir:
                libs[f"{p} base"] = _gemm_lib(p, base_dir)
    peaks = {p: _peak_fn(p) for p in paths if p in _PEAK}
    cases = []
    for m in rows:
        for n, k in SHAPES:
            x, w = torch.randn(m, k).bfloat16(), (torch.randn(n, k) / k ** 0.5).bfloat16()
            y = torch.empty(m, n)
            calls = {name: (lambda L=L, x=x, w=w, y=y, m=m, n=n, k=k:
                            L.tritium_bf16_gemm(x.data_ptr(), w.data_ptr(), y.data_ptr(), m, n, k))
                     for name, L in libs.items()}
            calls["torch bf16"] = lambda x=x, w=w: torch.nn.functional.linear(x, w)
            if cpu_linear._onednn_packing():
                pw = torch.ops.mkldnn._reorder_linear_weight(w, None)
                calls["oneDNN"] = lambda x=x, pw=pw: torch.ops.mkldnn._linear_pointwise(x, pw, None, "none", [], "")
            cases.append(((m, n, k), calls))
    best: Dict = {}
    peak_best: Dict[str, float] = {}
    for _ in range(rounds):
        for p, fn in peaks.items():
            peak_best[p] = max(peak_best.get(p, 0.0), fn())
        for key, calls in cases:
            flops = 2 * key[0] * key[1] * key[2]
            for name, fn in calls.items():
                fn()
                g = flops / _cpu_s(fn) / 1e9
                best.setdefault(key, {})[name] = max(best.get(key, {}).get(name, 0.0), g)
    return best, peak_best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--paths", nargs="+", choices=("avx512", "avx2"), default=None,
                   help="native paths to time (default: the x86 SIMD paths this host runs)")
    p.add_argument("--rows", type=int, nargs="+", default=[64, 256, 512], help="rows per call (default 64 256 512)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--base-kernels", default=None, help="a directory of another revision's kernels/*.c, *.h")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    paths = args.paths or [x for x in ("avx512", "avx2") if x in cpu_isa.runnable()]
    bad = [x for x in paths if x not in cpu_isa.runnable()]
    if bad or not paths:
        p.error(f"--paths: this CPU cannot run {', '.join(bad) or 'avx512 or avx2'}; "
                f"allowed here: {', '.join(x for x in cpu_isa.runnable() if x != 'generic') or 'none'}")
    if args.base_kernels and not os.path.isdir(args.base_kernels):
        p.error(f"--base-kernels {args.base_kernels}: not a directory")
    best, peaks = run(paths, args.rows, args.rounds, args.base_kernels)
    print("peak GFLOP/s on this core: " + ", ".join(
        f"{p} ({'VDPBF16PS' if p == 'avx512' else '256-bit FMA'}) {g:.1f}" for p, g in peaks.items()))
    cols = list(next(iter(best.values())).keys())
    print("one thread, GFLOP/s (best of %d rounds); in brackets: share of the path's peak" % args.rounds)
    print(f"{'M':>5s} {'N x K':>11s}" + "".join(f"{c:>18s}" for c in cols))
    for (m, n, k), d in best.items():
        line = f"{m:5d} {f'{n}x{k}':>11s}"
        for c in cols:
            pk = peaks.get(c.split()[0]) if c.split()[0] in peaks else None
            share = f" ({d[c] / pk:.0%})" if pk else ""
            line += f"{d[c]:>11.1f}{share:>7s}"
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
