"""The few-row GEMMs of a decode step streaming their weights from memory, against a pure read of
the same bytes: a benchmark that prints figures.

    python -m tritium.client.bench.gemv_bench [--paths avx512 avx2] [--rows 1 2 4] [--layers 30]
        [--kinds bf16 w8a8 w4a8] [--rounds 5] [--pages 4k huge] [--base-kernels DIR]

SmolLM2-135M's linears (gate_up 3072x576, gate or up 1536x576, down 576x1536, q / o 576x576, k / v
192x576), --layers distinct copies of each (30 layers: 212 MB of bf16 weights, more than any L3
here, so the weights come from DRAM as in a decode step; one copy measures the caches), called
layer by layer in the model's order: the bf16 GEMM (kernels/cpu_gemm_bf16.c) and the integer-dot
W8A8 / W4A8 GEMM (cpu_gemm_i8dot.c, asymmetric groups of 32 as the default builds store them;
W4A8 with its zeros folded into the codes, kernels/i8dot_pack.py). Each
round runs every path (forced with TRITIUM_CPU_ISA), kind and row count in turn, then a plain read
of the same bytes in the same order (a small C loop XOR-ing 64-byte words, asking for the lines
16 KB ahead); prints each shape's GB/s of weight bytes (codes, scales and zeros for the integer
kinds), all shapes together, the read's, and the ratio GEMM / read (1.0: the GEMM streams at read
speed); each call's and each tensor's read best time over the rounds, summed: a call the busy host
preempted does not count. --pages: where the weights lie, 4k (torch's allocations,
4 KiB pages where THP is `madvise`) and / or huge (one buffer on 2 MiB pages, kernels/hugepages.py,
the integer-dot kernels told so: tritium_i8dot_huge_pages), each placement timed in every round.
--base-kernels DIR: also time the kernels compiled from DIR (another revision's kernels/*.c, *.h,
e.g. `git archive main kernels | tar -x -C DIR`, then DIR/kernels) in every round, interleaved with
this tree's: rows `path+base` (W4A8: a base library from before the folded zeros reads the same
bytes through its float-zero int4 kernel, int16 zc taken as float16 zeros: the same work, its
values meaningless).
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
_READ_C = """#include <stdint.h>
uint64_t gemv_bench_read(const uint64_t *p, int64_t n) { /* n words, a multiple of 8 */
    uint64_t a[8] = {0};
    for (int64_t i = 0; i < n; i += 8) {
        __builtin_prefetch(p + i + 2048, 0, 2); /* 16 KB ahead, as the GEMMs ask */
        for (int j = 0; j < 8; j++) a[j] ^= p[i + j];
    }
    return a[0] ^ a[1] ^ a[2] ^ a[3] ^ a[4] ^ a[5] ^ a[6] ^ a[7];
}
"""


def _reader(path: str):
    src = os.path.join(cpu_isa.cache_dir(), "gemv_bench_read.c")
    os.makedirs(os.path.dirname(src), exist_ok=True)
    with open(src, "w") as f:
        f.write(_READ_C)
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    lib = ctypes.CDLL(cpu_isa.build(cc, path, [src], []))
    lib.gemv_bench_read.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.gemv_bench_read.restype = ctypes.c_uint64
    return lib.gemv_bench_read


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


def _round(lib, kind: str, m: int, ws, x, y) -> List[List[float]]:
    """Seconds per call, [layer][shape]."""
    out = []
    for row in ws:
        out.append([])
        for _, args, n, k, _ in row:
            t0 = time.perf_counter()
            if kind == "bf16":
                lib.tritium_bf16_gemm(x.data_ptr(), args[0], y.data_ptr(), m, n, k)
            else:
                lib.tritium_i8dot_gemm(x.data_ptr(), *args, y.data_ptr(), m, n, k, 8 if kind == "w8a8" else ip.FOLD4)
            out[-1].append(time.perf_counter() - t0)
    return out


def _libs(paths: List[str], base_dir: str = None):
    """(label, library) per path: this tree's kernels, then base_dir's (label path+base)."""
    from tritium.client.bench.workload_profile import base_lib
    for path in paths:
        cpu_native.use_path(path)
        yield path, cpu_native._lib()
        if base_dir:
            yield path + "+base", base_lib(base_dir)


def run(paths: List[str], kinds: List[str], rows: List[int], layers: int, rounds: int,
        pages: Tuple[str, ...] = ("4k",), base_dir: str = None) -> Dict:
    ws = {(kind, pg): _weights(kind, layers, pg == "huge") for kind in kinds for pg in pages}
    x = torch.randn(max(rows), max(k for _, k in SHAPES)).bfloat16()
    y = torch.empty(max(rows), max(n for n, _ in SHAPES))
    read = _reader(cpu_isa.runnable()[0])
    best: Dict = {}
    for _ in range(rounds):
        for path, lib in _libs(paths, base_dir):
            for kind in kinds:
                for pg in pages:
                    lib.tritium_i8dot_huge_pages(int(pg == "huge"))
                    for m in rows:
                        t = _round(lib, kind, m, ws[(kind, pg)], x, y)
                        b = best.get((path, kind, pg, m), t)
                        best[(path, kind, pg, m)] = [[min(a, c) for a, c in zip(u, v)] for u, v in zip(b, t)]
                lib.tritium_i8dot_huge_pages(0)
        for kind in kinds:
            for pg in pages:
                key = ("read", kind, pg)
                ts = []
                for row in ws[(kind, pg)]:
                    for w in row:
                        for t in w[0]:
                            t0 = time.perf_counter()
                            read(t.data_ptr(), t.numel() * t.element_size() // 64 * 8)
                            ts.append(time.perf_counter() - t0)
                best[key] = [min(a, c) for a, c in zip(best.get(key, ts), ts)]
    return best


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
    with cpu_native.paths_restored():
        best = run(paths, args.kinds, args.rows, args.layers, args.rounds, tuple(args.pages), args.base_kernels)
    print(f"threads={os.environ.get('OMP_NUM_THREADS', 'all')} layers={args.layers} each call's best of {args.rounds} rounds; "
          f"GB/s of weight bytes")
    head = "".join(f"{f'{n}x{k}':>11s}" for n, k in SHAPES)
    print(f"{'path':12s}{'kind':6s}{'pages':6s}{'rows':>5s}{head}{'all':>8s}{'read':>8s}{'/read':>7s}")
    for kind in args.kinds:
        nbytes = [w[4] * args.layers for w in _weights(kind, 1)[0]]
        for pg in args.pages:
            rd = sum(nbytes) / sum(best[("read", kind, pg)]) / 1e9
            for path in [q for p_ in paths for q in ((p_, p_ + "+base") if args.base_kernels else (p_,))]:
                for m in args.rows:
                    t = [sum(call[s] for call in best[(path, kind, pg, m)]) for s in range(len(SHAPES))]
                    per = "".join(f"{b / s / 1e9:11.1f}" for b, s in zip(nbytes, t))
                    tot = sum(nbytes) / sum(t) / 1e9
                    print(f"{path:12s}{kind:6s}{pg:6s}{m:5d}{per}{tot:8.1f}{rd:8.1f}{tot / rd:7.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
