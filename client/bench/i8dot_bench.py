"""Weight-only vs integer-dot (W8A8 / W4A8) CPU linears on a model's shapes: a benchmark that
prints figures.

    python -m tritium.client.bench.i8dot_bench [--rows 1,16] [--reps 200] [--threads N]
    python -m tritium.client.bench.i8dot_bench --gops [--rows 16,64,256,512] [--reps 20] [--base-kernels DIR]

For SmolLM2-135M's four linears of a layer (qkv 960x576, o 576x576, gate_up 3072x576, down
576x1536), int8 as the engine's default build of that model stores them (asymmetric groups of 32)
and int4-rtn (groups of 32), each weight packed by kernels/cpu_linear.py twice: activation_quant
none (the weight-only kernels) and int8 (cpu_gemm_i8dot.c). The calls are interleaved (so load from
other processes hits both alike) and the median time of the four linears together is printed per
row count, with the ratio weight-only / integer-dot (above 1: integer-dot faster), and the best
of the repetitions (other processes only ever add time, so on a busy host the best is the steadier
figure), with the ISA path the native library was built for.

--gops: the integer-dot GEMMs alone (W8A8 and W4A8, the same four linears, asymmetric groups of 32)
in GOPS (2 operations per multiply-add, best of the repetitions) per row count, beside the path's
peak measured on this core in the same loop (tritium_i8dot_peak: 12 independent chains of the
block kernel's core instructions, AVX-512 VPDPBUSD; AVX2 VPSIGNB + VPMADDUBSW + VPMADDWD + VPADDD
for int8, VPMADDUBSW + VPADDW for int4), and each GEMM's share of that peak. --base-kernels DIR
(another revision's kernels/*.c and *.h, e.g. `git archive main kernels | tar -x`): the same GEMMs
through that revision's library too, interleaved, with the ratio, after checking that both give
the same bits (int4: on the float-zero layout, `repack(fold=False)`, which the base library runs;
this tree runs int4 with the zeros folded into the codes, kernels/i8dot_pack.py).
"""
from __future__ import annotations

import argparse
import collections
import ctypes
import statistics
import time

import torch

from tritium.kernels import cpu_native, i8dot_pack, ops

SHAPES = (("qkv_proj", 960, 576), ("o_proj", 576, 576), ("gate_up_proj", 3072, 576), ("down_proj", 576, 1536))


def _buffers(method: str, n: int, k: int, g: int = 32) -> dict:
    if method == "int8":
        return {"qweight": torch.randint(-128, 128, (n, k), dtype=torch.int8),
                "scales": torch.rand(k // g, n) / 50 + 1e-3, "zeros": torch.randn(k // g, n) / 50}
    scales = (torch.rand(k // g, n) / 10 + 1e-3).half()
    return {"qweight": torch.randint(0, 256, (n, k // 2), dtype=torch.uint8),
            # float16, as engines store int4 parameters (the int4 kernels read them as stored); zeros
            # as a GGUF Q4_1 grid gives them (the block minimum m in [-15 d, 0]: z = m + 8 d)
            "scales": scales, "zeros": (scales.float() * (torch.rand(k // g, n) * 15 - 7)).half()}


def _int4_classic(b: dict, g: int = 32):
    """The int4 buffers' integer-dot weight with the float zero term (repack fold=False: the
    layout and numerics before the folded zeros; what --base-kernels' library reads)."""
    q = b["qweight"]
    c = torch.stack((q & 0x0F, q >> 4), dim=2).reshape(q.shape[0], -1).to(torch.int32) - 8
    return i8dot_pack.repack(c, b["scales"], b["zeros"], g, 4, fold=False)


def _gemm(lib, x: torch.Tensor, w) -> torch.Tensor:
    """One integer-dot GEMM through `lib` (this tree's library or --base-kernels')."""
    n, k = w.shape
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    lib.tritium_i8dot_gemm(x.data_ptr(), w.codes.data_ptr(), w.d.data_ptr(), w.z.data_ptr() if w.z is not None else None,
                           w.r.data_ptr(), y.data_ptr(), x.shape[0], n, k, w.kernel_bits)
    return y


def _gops(rows, reps: int, base_dir=None) -> None:
    lib = cpu_native._lib()
    lib.tritium_i8dot_peak.argtypes = [ctypes.c_int64, ctypes.c_int64]  # bound here: a probe, not a kernel
    lib.tritium_i8dot_peak.restype = ctypes.c_int64
    libs = {"": lib}
    if base_dir:
        from tritium.client.bench.workload_profile import base_lib
        libs["base "] = base_lib(base_dir)
    print(f"ISA path {cpu_native.isa()}, {reps} reps, best: GOPS (share of the path's measured peak)"
          + ("; base: the kernels of --base-kernels, the same calls interleaved, outputs compared bit for bit"
             if base_dir else ""))
    torch.manual_seed(0)
    packs, classic = {}, {}  # classic: int4 with the float zero term, what base's library reads
    for method in ("int8", "int4"):
        bufs = [_buffers(method, n, k) for _, n, k in SHAPES]
        packs[method] = [ops.pack_cpu_linear(method, b, torch.bfloat16, 32, activation_quant="int8").tensors[0]
                         for b in bufs]
        classic[method] = packs[method] if method == "int8" else [_int4_classic(b) for b in bufs]
    for m in rows:
        xs = [torch.randn(m, k).to(torch.bfloat16) for _, _, k in SHAPES]
        work = sum(2 * m * n * k for _, n, k in SHAPES)
        best = collections.defaultdict(float)
        for method, ws in packs.items():
            for x, w, wc in zip(xs, ws, classic[method]):
                if base_dir and not torch.equal(_gemm(lib, x, wc), _gemm(libs["base "], x, wc)):
                    raise SystemExit(f"{method} rows {m}: this tree's bits differ from --base-kernels'")
                if w is not wc:  # folded zeros: the zero moves by at most d / 16, so the results stay close
                    y, yc = _gemm(lib, x, w), _gemm(lib, x, wc)
                    if (y - yc).norm() > 0.05 * yc.norm():
                        raise SystemExit(f"{method} rows {m}: folded zeros far from the float zero term")
        for _ in range(reps):
            for form in (8, 4):
                t0 = time.perf_counter()
                macs = lib.tritium_i8dot_peak(200000, form)
                best[form] = max(best[form], 2 * macs / (time.perf_counter() - t0) / 1e9)
            for method in packs:
                for tag, lb in libs.items():
                    ws = classic[method] if tag else packs[method]
                    t0 = time.perf_counter()
                    for x, w in zip(xs, ws):
                        _gemm(lb, x, w)
                    best[tag + method] = max(best[tag + method], work / (time.perf_counter() - t0) / 1e9)
        line = "  ".join(f"W{8 if me == 'int8' else 4}A8 {best[me]:6.1f} GOPS"
                         + (f" ({best[me] / best[f]:4.0%} of {best[f]:.0f})" if best[f] else "")
                         + (f", base {best['base ' + me]:6.1f} ({best[me] / best['base ' + me]:.2f}x)" if base_dir else "")
                         for me, f in (("int8", 8), ("int4", 4)))
        print(f"rows {m:3d}: {line}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,16", help="comma-separated row counts (default 1,16)")
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--gops", action="store_true", help="integer-dot GEMMs' GOPS against the path's peak")
    p.add_argument("--base-kernels", default=None,
                   help="with --gops: also another revision's kernels (a directory of kernels/*.c, *.h), bits compared")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not cpu_native.available():
        print("native CPU kernels unavailable here (TRITIUM_NATIVE_CPU=0, no compiler or an unsupported CPU)")
        return 0
    if args.gops:
        _gops([int(r) for r in (args.rows if args.rows != "1,16" else "16,64,256,512").split(",")], args.reps,
              args.base_kernels)
        return 0
    print(f"ISA path {cpu_native.isa()}, torch threads {torch.get_num_threads()}, {args.reps} reps: median | best")
    torch.manual_seed(0)
    for method in ("int8", "int4"):
        packs = {mode: [] for mode in ("none", "int8")}
        for _, n, k in SHAPES:
            b = _buffers(method, n, k)
            for mode in packs:
                packs[mode].append((k, ops.pack_cpu_linear(method, b, torch.bfloat16, 32, activation_quant=mode)))
        for m in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(m, k).to(torch.bfloat16) for _, _, k in SHAPES}
            times = {mode: [] for mode in packs}
            for _ in range(args.reps):
                for mode, ps in packs.items():
                    t0 = time.perf_counter()
                    for k, pk in ps:
                        ops.cpu_linear(xs[k], pk)
                    times[mode].append(time.perf_counter() - t0)
            wo, i8 = (statistics.median(times[mode]) * 1e6 for mode in ("none", "int8"))
            bwo, bi8 = (min(times[mode]) * 1e6 for mode in ("none", "int8"))
            print(f"{method} rows {m:3d}: weight-only {wo:8.1f} us  integer-dot {i8:8.1f} us  ratio {wo / i8:5.2f}x"
                  f"  | best of {args.reps}: {bwo:8.1f} us  {bi8:8.1f} us  ratio {bwo / bi8:5.2f}x  (one layer's 4 linears)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
