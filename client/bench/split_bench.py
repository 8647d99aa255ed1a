"""The per-op kernels' thread split under preemption: a benchmark that prints figures.

    python -m tritium.client.bench.split_bench --base-kernels DIR [--threads 2] [--rows 64 256 512]
        [--loads 0/4 1/4 2/8] [--kinds bf16 int8 int4] [--reps 30] [--rounds 2]

The c16 workload's big GEMMs on --threads threads (SmolLM2-135M: gate_up 3072x576, down 576x1536,
qkv 960x576, o 576x576 at --rows rows, and the LM head 49152x576 at 16 rows: the sampled rows of a
16-request step), for the bf16 engine (tritium_bf16_gemm), int8 (W8A8) and int4 (W4A8)
(tritium_i8dot_gemm; the head of both the int6 head, tritium_head6_gemm), each call timed by the
wall clock, this tree's kernels against DIR's (another revision's kernels/*.c, *.h, e.g. main's:
`git archive main kernels | tar -x -C /tmp/base`), call by call alternated. A background process
(--loads W/P: busy W ms of every P ms, as the server's delivery thread, tritonserver and the client
take a core for a moment; 0/P: none) runs during each load's rounds. Prints per call the wall ms of
each, as the mean of all calls but the slowest 5 % (the preempted calls are the cost, so not the
median; the slowest few, where the whole process waited for a core on a shared host, are noise)
and the median, and the ratio this tree / base; and the process's CPU ms per call (mean).
The instruction-set path follows TRITIUM_CPU_ISA as everywhere.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable, Dict, List, Tuple

import torch

from tritium.client.bench.bg_load import Load, parse_load
from tritium.kernels import cpu_native, head_pack
from tritium.kernels import i8dot_pack as ip

SHAPES = (("gate_up", 3072, 576), ("down", 576, 1536), ("qkv", 960, 576), ("o", 576, 576))
HEAD = ("LM head", 49152, 576, 16)  # (name, N, K, rows)
KINDS = ("bf16", "int8", "int4")
def _weights(kind: str, n: int, k: int, head: bool):
    g = torch.Generator().manual_seed(n * 7 + k)
    if kind == "bf16":
        return (torch.randn(n, k, generator=g) / k ** 0.5).to(torch.bfloat16)
    if head:
        return head_pack.repack6(torch.randint(-32, 32, (n, k), generator=g),
                                 (torch.rand(k // 64, n, generator=g) / 50 + 1e-3).half(), 64)
    bits = 8 if kind == "int8" else 4
    lo, hi = (-128, 128) if bits == 8 else (-8, 8)
    return ip.repack(torch.randint(lo, hi, (n, k), generator=g), torch.rand(k // 64, n, generator=g) / 40 + 1e-4,
                     torch.randn(k // 64, n, generator=g) / 20, 64, bits)


def _call(kind: str, head: bool, x: torch.Tensor, w) -> Callable[[], object]:
    if kind == "bf16":
        return lambda: cpu_native.bf16_gemm(x, w)
    return (lambda: cpu_native.head6_gemm(x, w)) if head else (lambda: cpu_native.i8dot_gemm(x, w))


def cases(kinds: List[str], rows: List[int]):
    """[(kind, name, rows, fn)] of every GEMM timed."""
    out = []
    for kind in kinds:
        for name, n, k in SHAPES:
            w = _weights(kind, n, k, False)
            for m in rows:
                out.append((kind, name, m, _call(kind, False, torch.randn(m, k).to(torch.bfloat16), w)))
        name, n, k, m = HEAD
        out.append((kind, name, m, _call(kind, True, torch.randn(m, k).to(torch.bfloat16), _weights(kind, n, k, True))))
    return out


def run(libs: Dict[str, object], kinds, rows, loads, reps: int, rounds: int, threads: int):
    """{(load, kind, name, rows): {lib: (trimmed mean wall s, median wall s, mean CPU s of this
    process) per call}}."""
    torch.set_num_threads(threads)
    original = cpu_native._lib
    current = {"lib": None}
    cpu_native._lib = lambda: libs[current["lib"]]
    todo = cases(kinds, rows)
    sums: Dict = {}
    try:
        for rnd in range(rounds):
            for load in loads:
                with Load(*load):
                    for kind, name, m, fn in todo:
                        order = list(libs) if rnd % 2 == 0 else list(libs)[::-1]
                        for lib in order:  # warm each library's code and the weights
                            current["lib"] = lib
                            fn()
                        acc = sums.setdefault((load, kind, name, m), {lib: ([], []) for lib in libs})
                        for i in range(reps):
                            for lib in (order if i % 2 == 0 else order[::-1]):
                                current["lib"] = lib
                                t0, c0 = time.perf_counter(), time.process_time()
                                fn()
                                acc[lib][0].append(time.perf_counter() - t0)
                                acc[lib][1].append(time.process_time() - c0)
    finally:
        cpu_native._lib = original
    return {key: {lib: stats(w, c) for lib, (w, c) in d.items()} for key, d in sums.items()}


def stats(wall: List[float], cpu: List[float]) -> Tuple[float, float, float]:
    w = sorted(wall)
    kept = w[:max(1, len(w) - len(w) // 20)]
    return sum(kept) / len(kept), w[len(w) // 2], sum(cpu) / len(cpu)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-kernels", required=True, help="a directory of another revision's kernels/*.c, *.h")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, nargs="+", default=[64, 256, 512])
    p.add_argument("--loads", type=parse_load, nargs="+", default=[(0.0, 4.0), (1.0, 4.0), (2.0, 8.0)])
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    p.add_argument("--reps", type=int, default=30, help="calls per library, case, load and round (default 30)")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    for flag, v in (("--threads", args.threads), ("--reps", args.reps), ("--rounds", args.rounds)):
        if v < 1:
            p.error(f"{flag} must be >= 1, got {v}")
    if any(m < 1 for m in args.rows):
        p.error(f"--rows must be >= 1, got {args.rows}")
    if not os.path.isdir(args.base_kernels):
        p.error(f"--base-kernels {args.base_kernels}: not a directory")
    if not cpu_native.available():
        p.error("the native CPU kernels are off or unavailable here (TRITIUM_NATIVE_CPU=0, or no compiler)")
    from tritium.client.bench.workload_profile import base_lib
    libs = {"this tree": cpu_native._lib(), "base": base_lib(args.base_kernels)}
    res = run(libs, args.kinds, args.rows, args.loads, args.reps, args.rounds, args.threads)
    print(f"path {cpu_native.isa()}, {args.threads} threads, mean ms per call over {args.reps * args.rounds} "
          f"calls each, alternated; wall: mean of the fastest 95 %, median; CPU of this process: mean; "
          f"load W/P: a process busy W ms of every P ms")
    print(f"{'load':>5s} {'kind':>5s} {'GEMM':>8s} {'rows':>5s} {'wall base':>10s} {'tree':>8s} {'ratio':>6s}"
          f" {'median ratio':>12s} {'CPU base':>9s} {'tree':>8s} {'ratio':>6s}")
    for (load, kind, name, m), d in res.items():
        (bw, bm, bc), (tw, tm, tc) = d["base"], d["this tree"]
        print(f"{f'{load[0]:g}/{load[1]:g}':>5s} {kind:>5s} {name:>8s} {m:5d} {1e3 * bw:10.3f} {1e3 * tw:8.3f} "
              f"{tw / bw:6.3f} {tm / bm:12.3f} {1e3 * bc:9.3f} {1e3 * tc:8.3f} {tc / bc:6.3f}")
    for load in args.loads:
        for kind in args.kinds:
            sel = [d for (ld, kd, *_), d in res.items() if ld == load and kd == kind]
            tot = {lib: [sum(d[lib][i] for d in sel) for i in (0, 2)] for lib in ("base", "this tree")}
            (bw, bc), (tw, tc) = tot["base"], tot["this tree"]
            print(f"load {load[0]:g}/{load[1]:g} {kind}: the GEMMs above, one call each: wall base {1e3 * bw:.2f} ms, "
                  f"this tree {1e3 * tw:.2f} ms ({tw / bw:.3f}x); CPU {1e3 * bc:.2f} / {1e3 * tc:.2f} ms ({tc / bc:.3f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
