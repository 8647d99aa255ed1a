"""The few-row GEMMs of a decode step streaming their weights from memory, against a pure read of
the same bytes: a benchmark that prints figures.

    python -m tritium.client.bench.gemv_bench [--paths avx512 avx2] [--rows 1 2 4] [--layers 30]
        [--kinds bf16 w8a8 w4a8] [--rounds 5] [--pages 4k huge] [--threads 1|2] [--base-kernels DIR]

SmolLM2-135M's linears (gate_up 3072x576, gate or up 1536x576, down 576x1536, q / o 576x576, k / v
192x576), --layers distinct copies of each (30 layers: 212 MB of bf16 weights, more than any L3
here, so the weights come from DRAM as in a decode step; one copy measures the caches), called
layer by layer in the model's order: the bf16 GEMM (kernels/cpu_gemm_bf16.c) and the integer-dot
W8A8 / W4A8 GEMM (cpu_gemm_i8dot.c, asymmetric groups of 32 as the default builds store them;
W4A8 with its zeros folded into the codes, kernels/i8dot_pack.py), each call timed in C (no Python
call in the timing, as in the native step). --threads: each per-op call on
one thread (1, a plain loop) or split by the kernels' OpenMP team of two (2, cpu_split.h).

The reference is a vector read of the same bytes in the same order (a small C loop, AVX-512 /
AVX2 loads, 4 lines a step, built for the host's best path): on one thread (read1: what one core
reads) and on two threads in one OpenMP region, each reading its contiguous share of every tensor
(read2: what the two cores read together). Each round, per kind and placement, times read2 and
read1 first, then every row count with this tree's kernels and the base's alternately (the order
flipped every round), and prints one line: the reads and each call set's GB/s of weight bytes, so
each round's figures sit beside the same second's 2-thread read. The host here flips every 10-30 s
between a state where two threads read about twice what one reads ("fast") and one where they read
about what one does ("slow"): the last table puts each round in its state by read2 / read1 >= FAST
and gives per state the median GB/s, the median of the rounds' this-tree / base ratios and the
median share of read2. The first table: each shape's GB/s of weight bytes (codes, scales and zeros
for the integer kinds), all shapes together, read1, the ratio all / read1 and read2, from each
call's and each read's best time over the rounds, summed (a call the busy host preempted does not
count). --pages: where the weights lie, 4k (torch's allocations, 4 KiB pages where THP is
`madvise`) and / or huge (one buffer on 2 MiB pages, kernels/hugepages.py, the integer-dot kernels
told so: tritium_i8dot_huge_pages), each placement timed in every round. --base-kernels DIR: also
time the kernels compiled from DIR (another revision's kernels/*.c, *.h, e.g. `git archive main
kernels | tar -x -C DIR`, then DIR/kernels) in every round, interleaved with this tree's: rows
`path+base` (W4A8: a base library from before the folded zeros reads the same bytes through its
float-zero int4 kernel, int16 zc taken as float16 zeros: the same work, its values meaningless).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import time
from typing import Dict, List, Tuple

import torch

from tritium.kernels import cpu_isa, cpu_native, hugepages
from tritium.kernels import i8dot_pack as ip

SHAPES = ((3072, 576), (1536, 576), (576, 1536), (576, 576), (192, 576))
_READ_C = r"""#include <stdint.h>
#include <time.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif
/* n bytes (a multiple of 64) at p, 64-byte lines: 4 lines a step in vector loads (AVX-512: one
 * load a line; AVX2: two), XOR-ed into 4 accumulators; no software prefetch (a single thread reads
 * as fast with or without one at any distance here). */
static uint64_t rd(const char *p, int64_t n) {
#if defined(__AVX512F__)
    __m512i a[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
    int64_t i = 0;
    for (; i + 256 <= n; i += 256)
        for (int j = 0; j < 4; j++) a[j] = _mm512_xor_si512(a[j], _mm512_loadu_si512((const void *)(p + i + 64 * j)));
    for (; i < n; i += 64) a[0] = _mm512_xor_si512(a[0], _mm512_loadu_si512((const void *)(p + i)));
    const __m512i s = _mm512_xor_si512(_mm512_xor_si512(a[0], a[1]), _mm512_xor_si512(a[2], a[3]));
    return (uint64_t)_mm512_reduce_or_epi64(s);
#elif defined(__AVX2__)
    __m256i a[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
    int64_t i = 0;
    for (; i + 128 <= n; i += 128)
        for (int j = 0; j < 4; j++) a[j] = _mm256_xor_si256(a[j], _mm256_loadu_si256((const __m256i *)(p + i + 32 * j)));
    for (; i < n; i += 32) a[0] = _mm256_xor_si256(a[0], _mm256_loadu_si256((const __m256i *)(p + i)));
    const __m256i s = _mm256_xor_si256(_mm256_xor_si256(a[0], a[1]), _mm256_xor_si256(a[2], a[3]));
    return (uint64_t)_mm256_extract_epi64(s, 0) ^ (uint64_t)_mm256_extract_epi64(s, 3);
#else
    uint64_t a[8] = {0};
    for (int64_t i = 0; i < n; i += 64)
        for (int j = 0; j < 8; j++) a[j] ^= ((const uint64_t *)(p + i))[j];
    return a[0] ^ a[1] ^ a[2] ^ a[3] ^ a[4] ^ a[5] ^ a[6] ^ a[7];
#endif
}

/* The timed calls, without the Python call's cost (about 1.5 us a call here): calls n = 0 .. ncalls - 1
 * of fn with the 10 (i8dot) or 6 (bf16) 64-bit arguments a[n * 10 ..], each call's seconds to secs[n]. */
typedef int (*i8dot_fn)(const void *, const void *, const void *, const void *, const void *, void *, int64_t,
                        int64_t, int64_t, int64_t);
typedef void (*bf16_fn)(const void *, const void *, void *, int64_t, int64_t, int64_t);
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}
void gemv_bench_calls(void *fn, int64_t i8dot, const int64_t *a, int64_t ncalls, double *secs) {
    for (int64_t n = 0; n < ncalls; n++, a += 10) {
        const double t0 = now();
        if (i8dot)
            ((i8dot_fn)fn)((const void *)a[0], (const void *)a[1], (const void *)a[2], (const void *)a[3],
                           (const void *)a[4], (void *)a[5], a[6], a[7], a[8], a[9]);
        else
            ((bf16_fn)fn)((const void *)a[0], (const void *)a[1], (void *)a[2], a[3], a[4], a[5]);
        secs[n] = now() - t0;
    }
}

/* The t tensors (ptrs, bytes) in order on `threads` threads of one region: each thread reads its
 * contiguous share (whole lines) of every tensor, as a per-op call's threads would split it.
 * secs (one thread only): each tensor's read seconds. */
uint64_t gemv_bench_read(const char *const *ptrs, const int64_t *bytes, int64_t t, int64_t threads, double *secs) {
    uint64_t acc = 0;
    if (threads == 1) {
        for (int64_t i = 0; i < t; i++) {
            const double t0 = now();
            acc ^= rd(ptrs[i], bytes[i] / 64 * 64);
            secs[i] = now() - t0;
        }
        return acc;
    }
#pragma omp parallel num_threads(threads) reduction(^ : acc)
    {
#ifdef _OPENMP
        const int64_t id = omp_get_thread_num(), nt = omp_get_num_threads();
#else
        const int64_t id = 0, nt = 1;
#endif
        for (int64_t i = 0; i < t; i++) {
            const int64_t lines = bytes[i] / 64, a = lines * id / nt, b = lines * (id + 1) / nt;
            acc ^= rd(ptrs[i] + 64 * a, 64 * (b - a));
        }
    }
    return acc;
}
"""


class Reader:
    """The vector read of a list of tensors on 1 or 2 threads (_READ_C, built for `path`)."""

    def __init__(self, path: str, tensors):
        src = os.path.join(cpu_isa.cache_dir(), "gemv_bench_read.c")
        os.makedirs(os.path.dirname(src), exist_ok=True)
        with open(src, "w") as f:
            f.write(_READ_C)
        cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
        self.lib = ctypes.CDLL(cpu_isa.build(cc, path, [src], []))
        self.lib.gemv_bench_read.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                             ctypes.c_void_p]
        self.lib.gemv_bench_read.restype = ctypes.c_uint64
        self.lib.gemv_bench_calls.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                              ctypes.c_void_p]
        self.lib.gemv_bench_calls.restype = None
        self.n = len(tensors)
        self.ptrs = (ctypes.c_void_p * self.n)(*[t.data_ptr() for t in tensors])
        self.sizes = (ctypes.c_int64 * self.n)(*[t.numel() * t.element_size() // 64 * 64 for t in tensors])
        self.bytes = sum(self.sizes)

    def __call__(self, threads: int) -> float:
        """Seconds to read every tensor once on `threads` threads (one thread: each tensor's in .secs)."""
        self.secs = (ctypes.c_double * self.n)()
        t0 = time.perf_counter()
        self.lib.gemv_bench_read(self.ptrs, self.sizes, self.n, threads, self.secs)
        return time.perf_counter() - t0


def _weights(kind: str, layers: int, huge: bool = False) -> List[List[Tuple]]:
    """[layer][shape] -> (tensors to stream, call args after x and before y, N, K, bytes); huge:
    all of them in one buffer on 2 MiB pages."""
    out = []
    base = []
    for n, k in SHAPES:
        if kind == "bf16":
            base.append((n, k, (torch.randn(n, k) / k ** 0.5).bfloat16()))
        else:
            bits = 8 if kind == "w8a8" else 4
            lo, hi = (-128, 128) if bits == 8 else (-8, 8)
            s = torch.rand(k // 32, n) / 50 + 1e-3
            # int4: zeros of a min/max (GGUF Q4_1) grid, z = min + 8 d, min in [-15 d, 0]: folded
            z = torch.randn(k // 32, n) / 50 if bits == 8 else s * (torch.rand(k // 32, n) * 15 - 7)
            w = ip.repack(torch.randint(lo, hi, (n, k)), s, z, 32, bits)
            assert bits == 8 or w.fold
            base.append((n, k, w))
    flat = [t for _ in range(layers) for _, _, w in base
            for t in ((w,) if kind == "bf16" else (w.codes, w.d, w.z, w.r))]
    moved = hugepages.to_huge_pages(flat) if huge else [t.clone() for t in flat]
    if moved is None:
        raise SystemExit("--pages huge: this host gives no huge pages (not Linux, THP never, or TRITIUM_HUGE_PAGES=0)")
    it = iter(moved)
    for _ in range(layers):
        row = []
        for n, k, w in base:
            if kind == "bf16":
                t = next(it)
                row.append(((t,), (t.data_ptr(),), n, k, t.numel() * 2))
            else:
                c, d, z, r = next(it), next(it), next(it), next(it)
                row.append(((c, d, z, r), (c.data_ptr(), d.data_ptr(), z.data_ptr(), r.data_ptr()), n, k,
                            sum(t.numel() * t.element_size() for t in (c, d, z, r))))
        out.append(row)
    return out


def _round(calls, lib, kind: str, m: int, ws, x, y) -> List[List[float]]:
    """Seconds per call, [layer][shape], the calls timed in C (Reader.lib.gemv_bench_calls)."""
    i8 = kind != "bf16"
    args = []
    for row in ws:
        for _, a, n, k, _ in row:
            if i8:
                args += [x.data_ptr(), *a, y.data_ptr(), m, n, k, 8 if kind == "w8a8" else ip.FOLD4]
            else:
                args += [x.data_ptr(), a[0], y.data_ptr(), m, n, k, 0, 0, 0, 0]
    ncalls = len(args) // 10
    arr = (ctypes.c_int64 * len(args))(*args)
    secs = (ctypes.c_double * ncalls)()
    fn = ctypes.cast(lib.tritium_i8dot_gemm if i8 else lib.tritium_bf16_gemm, ctypes.c_void_p).value
    calls(fn, int(i8), arr, ncalls, secs)
    per = len(ws[0])
    return [list(secs[i * per:(i + 1) * per]) for i in range(len(ws))]


def _libs(paths: List[str], base_dir: str = None) -> List[Tuple[str, ctypes.CDLL]]:
    """(label, library) per path: this tree's kernels, then base_dir's (label path+base)."""
    from tritium.client.bench.workload_profile import base_lib
    out = []
    for path in paths:
        cpu_native.use_path(path)
        out.append((path, cpu_native._lib()))
        if base_dir:
            out.append((path + "+base", base_lib(base_dir)))
    return out


def _omp_threads(n: int) -> None:
    """The OpenMP team of the kernels' per-op calls: n threads (the runtime the kernels and torch
    share, libgomp.so.1)."""
    gomp = ctypes.CDLL("libgomp.so.1")
    gomp.omp_set_num_threads(n)
    if gomp.omp_get_max_threads() != n:
        raise SystemExit(f"--threads: the OpenMP runtime kept {gomp.omp_get_max_threads()} threads, not {n}")


def run(paths: List[str], kinds: List[str], rows: List[int], layers: int, rounds: int,
        pages: Tuple[str, ...] = ("4k",), base_dir: str = None, threads: int = 1, log=print) -> Dict:
    """best[(label, kind, pages, rows)]: each call's best seconds, [layer][shape];
    best[("read1", kind, pages)]: each tensor's best seconds on one thread; best[("read2", ...)]: the
    best seconds of the whole 2-thread read;
    rounds[(kind, pages)]: per round {"read1", "read2", (label, rows): seconds of all the calls}."""
    ws = {(kind, pg): _weights(kind, layers, pg == "huge") for kind in kinds for pg in pages}
    x = torch.randn(max(rows), max(k for _, k in SHAPES)).bfloat16()
    y = torch.empty(max(rows), max(n for n, _ in SHAPES))
    rpath = cpu_isa.runnable()[0]
    readers = {key: Reader(rpath, [t for row in w for c in row for t in c[0]]) for key, w in ws.items()}
    libs = _libs(paths, base_dir)
    _omp_threads(threads)
    best: Dict = {}
    per: Dict = {key: [] for key in ws}
    for rnd in range(rounds):
        for (kind, pg), w in ws.items():
            rd = readers[(kind, pg)]
            rec = {"read2": rd(2), "read1": rd(1), "clock": time.strftime("%H:%M:%S")}
            key = ("read1", kind, pg)  # each tensor's best, as each call's
            best[key] = [min(a, c) for a, c in zip(best.get(key, rd.secs), rd.secs)]
            for m in rows:
                # this tree and the base alternate call sets, the order flipped every round
                for label, lib in (libs if rnd % 2 == 0 else libs[::-1]):
                    lib.tritium_i8dot_huge_pages(int(pg == "huge"))
                    t = _round(rd.lib.gemv_bench_calls, lib, kind, m, w, x, y)
                    lib.tritium_i8dot_huge_pages(0)
                    b = best.get((label, kind, pg, m), t)
                    best[(label, kind, pg, m)] = [[min(a, c) for a, c in zip(u, v)] for u, v in zip(b, t)]
                    rec[(label, m)] = sum(map(sum, t))
            best[("read2", kind, pg)] = min(best.get(("read2", kind, pg), rec["read2"]), rec["read2"])
            per[(kind, pg)].append(rec)
            gb = rd.bytes / 1e9
            log(f"round {rnd + 1:2d} {rec['clock']} {kind:5s} {pg:4s} read2 {gb / rec['read2']:5.1f} read1 "
                f"{gb / rec['read1']:5.1f} | " + " ".join(f"{lb}:{m} {gb / rec[(lb, m)]:5.1f}" for m in rows
                                                          for lb, _ in libs))
    best["rounds"] = per
    return best


def _median(v: List[float]) -> float:
    v = sorted(v)
    return (v[len(v) // 2] + v[(len(v) - 1) // 2]) / 2 if v else float("nan")


FAST = 1.4  # a round is in the host's fast state when its 2-thread read is >= FAST x its 1-thread read


def report(best: Dict, paths: List[str], kinds: List[str], rows: List[int], layers: int, pages, base: bool,
           threads: int, rounds: int) -> None:
    labels = [q for p_ in paths for q in ((p_, p_ + "+base") if base else (p_,))]
    print(f"threads={threads} layers={layers}: each call's best of {rounds} rounds, summed; GB/s of weight bytes; "
          f"read1 / read2: a vector read of the same bytes on 1 / 2 threads")
    head = "".join(f"{f'{n}x{k}':>11s}" for n, k in SHAPES)
    print(f"{'path':12s}{'kind':6s}{'pages':6s}{'rows':>5s}{head}{'all':>8s}{'read1':>8s}{'/read1':>7s}{'read2':>8s}")
    for kind in kinds:
        nbytes = [w[4] * layers for w in _weights(kind, 1)[0]]
        for pg in pages:
            r1 = sum(nbytes) / sum(best[("read1", kind, pg)]) / 1e9
            r2 = sum(nbytes) / best[("read2", kind, pg)] / 1e9
            for path in labels:
                for m in rows:
                    t = [sum(call[s] for call in best[(path, kind, pg, m)]) for s in range(len(SHAPES))]
                    per = "".join(f"{b / s / 1e9:11.1f}" for b, s in zip(nbytes, t))
                    tot = sum(nbytes) / sum(t) / 1e9
                    print(f"{path:12s}{kind:6s}{pg:6s}{m:5d}{per}{tot:8.1f}{r1:8.1f}{tot / r1:7.2f}{r2:8.1f}")
    # per host state: the rounds whose same-second 2-thread read was fast / slow, medians
    print(f"\nper host state (fast: read2 >= {FAST} read1), medians of the rounds' figures: GB/s [rounds]"
          + ("; x base: the median of each round's this-tree / base ratio" if base else ""))
    print(f"{'path':12s}{'kind':6s}{'pages':6s}{'rows':>5s}{'fast':>8s}{'x base':>8s}{'/read2':>7s}{'n':>4s}"
          f"{'slow':>8s}{'x base':>8s}{'/read2':>7s}{'n':>4s}")
    for kind in kinds:
        gb = sum(w[4] * layers for w in _weights(kind, 1)[0]) / 1e9
        for pg in pages:
            recs = best["rounds"][(kind, pg)]
            groups = ([r for r in recs if r["read1"] / r["read2"] >= FAST], [r for r in recs if r["read1"] / r["read2"] < FAST])
            for path in paths:
                for m in rows:
                    cells = ""
                    for g in groups:
                        rate = _median([gb / r[(path, m)] for r in g])
                        ratio = _median([r[(path + "+base", m)] / r[(path, m)] for r in g]) if base else float("nan")
                        share = _median([r["read2"] / r[(path, m)] for r in g])
                        cells += f"{rate:8.1f}{ratio:8.2f}{share:7.2f}{len(g):4d}"
                    print(f"{path:12s}{kind:6s}{pg:6s}{m:5d}{cells}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--paths", nargs="+", choices=cpu_isa.PATHS, default=None,
                   help="native paths to time (default: every path this host runs)")
    p.add_argument("--kinds", nargs="+", choices=("bf16", "w8a8", "w4a8"), default=["bf16", "w8a8", "w4a8"])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4], help="rows per call (default 1 2 4)")
    p.add_argument("--layers", type=int, default=30, help="distinct copies of each weight (default 30)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--pages", nargs="+", choices=("4k", "huge"), default=["4k", "huge"],
                   help="where the weights lie: torch's allocations (4k) and / or 2 MiB pages (huge); default both")
    p.add_argument("--threads", type=int, choices=(1, 2), default=1,
                   help="threads of each per-op call: 1 (a plain loop) or 2 (the kernels' OpenMP split); default 1")
    p.add_argument("--base-kernels", default=None,
                   help="a directory of another revision's kernels/*.c, *.h, timed interleaved (rows path+base)")
    args = p.parse_args(argv)
    paths = args.paths or cpu_isa.runnable()
    bad = [x for x in paths if x not in cpu_isa.runnable()]
    if bad:
        p.error(f"--paths: this CPU cannot run {', '.join(bad)}; allowed here: {', '.join(cpu_isa.runnable())}")
    if args.layers < 1 or args.rounds < 1 or min(args.rows) < 1:
        p.error("--layers, --rounds and --rows must be >= 1")
    if args.base_kernels is not None and not os.path.isdir(args.base_kernels):
        p.error(f"--base-kernels: {args.base_kernels!r} is not a directory")
    gomp = ctypes.CDLL("libgomp.so.1")
    saved = gomp.omp_get_max_threads()
    try:
        with cpu_native.paths_restored():
            best = run(paths, args.kinds, args.rows, args.layers, args.rounds, tuple(args.pages), args.base_kernels,
                       args.threads)
    finally:
        gomp.omp_set_num_threads(saved)
    report(best, paths, args.kinds, args.rows, args.layers, args.pages, args.base_kernels is not None, args.threads,
           args.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
