"""Tensor-parallel benchmark: the same model at TP = 1 and TP = N, in-process, interleaved.

    python -m tritium.client.bench.bench_tp ENGINE_TP1 ENGINE_TPN [--rounds 3] [--threads 2]

Systems: TP = 1 with --threads torch threads; TP = N with --threads / N per rank (rank 0 in this
process, the others in its workers), so both use the same cores; and TP = 1 with --threads / N
threads (the same per-process thread count as a rank: on a busy machine, OpenMP threads that
get preempted stall at every barrier, which can cost a multi-threaded run more than it gains). Workloads (greedy, EOS
ignored): one stream decoding 128 tokens after a 16-token prompt (ms per output token), 8
streams decoding 64 tokens each (output tokens/s), and one 512-token prefill (seconds). Each
round runs both systems back to back; the table gives the median over rounds and TP=N / TP=1.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from tritium.backend.config import EngineConfig
from tritium.backend.engine import LLMEngine
from tritium.backend.sampling_params import SamplingParams


def _ids(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 20000, (n,), generator=g).tolist()


def measure(engine: LLMEngine) -> dict:
    out = {}
    p = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    engine.generate(prompt_token_ids=[_ids(16, 0)], params=SamplingParams(max_tokens=4, ignore_eos=True))  # warm
    t = time.perf_counter()
    engine.generate(prompt_token_ids=[_ids(16, 1)], params=p)
    out["decode_1_ms_per_token"] = (time.perf_counter() - t) * 1000 / 128
    p8 = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    engine.generate(prompt_token_ids=[_ids(16, 10 + i) for i in range(8)], params=p8)
    out["decode_8_tokens_per_s"] = 8 * 64 / (time.perf_counter() - t)
    t = time.perf_counter()
    engine.generate(prompt_token_ids=[_ids(512, 2)], params=SamplingParams(max_tokens=1, ignore_eos=True))
    out["prefill_512_s"] = time.perf_counter() - t
    return out


def run_one(engine_dir: str, per_rank: int) -> dict:
    torch.set_num_threads(per_rank)
    with LLMEngine(engine_dir, device="cpu", num_kv_blocks=256, threads_per_rank=per_rank) as eng:
        return measure(eng)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tritium.client.bench.bench_tp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("tp1", help="engine built with --tensor-parallel-size 1")
    p.add_argument("tpn", help="the same model built with --tensor-parallel-size N")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="cores to use in total (default 2)")
    args = p.parse_args(argv)
    n = EngineConfig.load(args.tpn).tensor_parallel_size
    per = max(1, args.threads // n)
    systems = {"tp1": (args.tp1, args.threads), "tpn": (args.tpn, per), "tp1_few": (args.tp1, per)}
    runs = {k: [] for k in systems}
    for r in range(args.rounds):
        order = list(systems) if r % 2 == 0 else list(reversed(systems))
        for key in order:
            runs[key].append(run_one(*systems[key]))
            print(f"round {r + 1} {key}: {runs[key][-1]}", flush=True)
    med = {k: {m: statistics.median(x[m] for x in v) for m in v[0]} for k, v in runs.items()}
    print(f"\n| metric | TP=1, {args.threads} threads | TP={n}, {per} thread/rank | TP=1, {per} thread(s) "
          f"| TP={n} / TP=1 {args.threads} thr | TP={n} / TP=1 {per} thr |")
    print("|---|---|---|---|---|---|")
    for m in med["tp1"]:
        a, b, c = med["tp1"][m], med["tpn"][m], med["tp1_few"][m]
        print(f"| {m} | {a:.3f} | {b:.3f} | {c:.3f} | {b / a:.2f} | {b / c:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
