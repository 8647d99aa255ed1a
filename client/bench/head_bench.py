"""The LM head's CPU kernels alone on SmolLM2's shape: a benchmark that prints figures.

    python -m tritium.client.bench.head_bench [--rows 1,4,16] [--reps 30] [--threads N]
        [--vocab 49152] [--hidden 576]

One int6 head (codes -32..31, float16 scales per 64, as `--embedding-quantization int6` stores it)
packed three ways by kernels/cpu_linear.py: the integer-dot head on the 6-bit codes (cpu_head.c,
W6A8, what int6 heads of bfloat16 engines run), the same codes widened to int8 through the
W8A8 kernel (cpu_gemm_i8dot.c: the int6 head's kernel before it read 6 bits) and the weight-only
grouped int8 kernel (cpu_gemm.c: TRITIUM_HEAD_DOT=0). The calls are interleaved; the best of the
repetitions (milliseconds per call) is printed per row count with each kernel's bytes per weight
read and its effective read bandwidth, with the ISA path the native library was built for.
"""
from __future__ import annotations

import argparse
import time

import torch

from tritium.kernels import cpu_native, ops
from tritium.kernels.quant_layouts import pack_int6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,4,16", help="comma-separated row counts (default 1,4,16)")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--hidden", type=int, default=576)
    args = p.parse_args(argv)
    try:
        rows = [int(r) for r in args.rows.split(",")]
        if min(rows) < 1:
            raise ValueError
    except ValueError:
        p.error(f"--rows must be a comma list of integers >= 1, got {args.rows!r}")
    if args.reps < 1 or args.hidden % 64 or args.vocab < 1:
        p.error("--reps must be >= 1, --hidden a multiple of 64, --vocab >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    if not cpu_native.available():
        p.error("the native CPU kernels are not available here (TRITIUM_NATIVE_CPU=0 or no C compiler)")
    n, k = args.vocab, args.hidden
    q = torch.randint(-32, 32, (n, k))
    stored = pack_int6(q)
    scales = (torch.rand(k // 64, n) / 50 + 1e-3).half()
    kinds = {
        "W6A8 (cpu_head.c)": (ops.pack_cpu_linear("int6", {"qweight": stored, "scales": scales}, torch.bfloat16, 64,
                                                  activation_quant="int8"), 6.25),
        "W8A8 on widened codes": (ops.pack_cpu_linear("int8", {"qweight": q.to(torch.int8), "scales": scales},
                                                      torch.bfloat16, 64, activation_quant="int8"), 8.5),
        "weight-only int8": (ops.pack_cpu_linear("int6", {"qweight": stored, "scales": scales}, torch.bfloat16, 64),
                             8.5),
    }
    print(f"ISA path {cpu_native.isa()}, torch threads {torch.get_num_threads()}, head {n} x {k}, "
          f"best of {args.reps}")
    print(f"{'rows':>5s}  " + "  ".join(f"{name:>24s}" for name in kinds) + "   (ms per call; GB/s read)")
    for m in rows:
        x = torch.randn(m, k).to(torch.bfloat16)
        best = {name: float("inf") for name in kinds}
        for _ in range(args.reps):
            for name, (packed, _) in kinds.items():
                t0 = time.perf_counter()
                ops.cpu_linear(x, packed)
                best[name] = min(best[name], time.perf_counter() - t0)
        cells = [f"{best[name] * 1e3:9.2f} ms {n * k * bits / 8 / best[name] / 1e9:6.1f} GB/s"
                 for name, (_, bits) in kinds.items()]
        print(f"{m:5d}  " + "  ".join(f"{c:>24s}" for c in cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
