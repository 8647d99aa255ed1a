"""MoE decode-step benchmark on CPU: `python -m tritium.client.bench.moe_bench`.

Times one decode step's feed-forward for a batch of B tokens three ways, in the same run:
    moe     ops.fused_moe over E experts, top-k routing (the CPU path: only routed experts)
    dense   a gated MLP whose intermediate size is k * I: the same active parameters per token
    loop    every expert over its tokens, all E visited (the naive form the CPU path avoids)
and prints median milliseconds and the ratios moe / dense and loop / moe. Defaults are a
Qwen3-30B-A3B-like layer scaled to fit a small host (hidden 1024, 64 experts of 384, top-8).
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from tritium.kernels import ops
from tritium.kernels.silu_mul_ref import silu_mul_ref


def _median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * sorted(times)[len(times) // 2]


def _loop_all(x, w13, w2, weights, ids):
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        y = F.linear(silu_mul_ref(F.linear(x[tok], w13[e])), w2[e])
        out.index_add_(0, tok, y * weights[tok, slot, None])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=384)
    p.add_argument("--batch", type=str, default="1,4,16")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--reps", type=int, default=20)
    a = p.parse_args(argv)
    dtype = getattr(torch, a.dtype)
    e, k, h, i = a.experts, a.top_k, a.hidden, a.intermediate
    torch.manual_seed(0)
    w13 = (torch.randn(e, 2 * i, h) / h ** 0.5).to(dtype)
    w2 = (torch.randn(e, h, i) / i ** 0.5).to(dtype)
    d13 = (torch.randn(2 * k * i, h) / h ** 0.5).to(dtype)
    d2 = (torch.randn(h, k * i) / i ** 0.5).to(dtype)
    print(f"hidden {h}, {e} experts of {i}, top-{k} | dense: intermediate {k * i} | {a.dtype}, "
          f"{torch.get_num_threads()} threads, median of {a.reps}")
    print(f"{'batch':>5} {'moe ms':>8} {'dense ms':>9} {'loop ms':>8} {'moe/dense':>9} {'loop/moe':>8}")
    for b in (int(s) for s in a.batch.split(",")):
        x = torch.randn(b, h).to(dtype)
        weights, ids = torch.topk(torch.softmax(torch.randn(b, e), -1), k, -1)
        weights = weights.to(dtype)
        with torch.inference_mode():
            moe = _median_ms(lambda: ops.fused_moe(x, w13, w2, weights, ids), a.reps)
            dense = _median_ms(lambda: F.linear(silu_mul_ref(F.linear(x, d13)), d2), a.reps)
            loop = _median_ms(lambda: _loop_all(x, w13, w2, weights, ids), a.reps)
        print(f"{b:>5} {moe:8.3f} {dense:9.3f} {loop:8.3f} {moe / dense:9.2f} {loop / moe:8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
