"""Two or more engines on the serving workload in one process, rounds alternated: a benchmark that
prints figures.

    python -m tritium.client.bench.engines_ab ENGINE_A ENGINE_B [...] [--threads 1] [--rounds 2]
        [--num-requests 32] [--concurrency 16]

Loads every engine into this process (an LLMEngine each, prefix caching off), then per round runs
`tritium bench`'s workload (bench_workload.make_requests: seeded prompts of 12-384 words, 16-256
output tokens, EOS ignored; workload_profile.run_workload keeps --concurrency requests in flight)
on each engine in turn, the order reversed on odd rounds, and prints each engine's output tokens/s
and tokens per CPU-second of the process, and each engine's tokens per CPU-second against the
first engine's of the same round. Engines compared in one process and round see the same host
load, so the ratio is the figure on a shared host (e.g. the int4 against the int8 engine).
"""
from __future__ import annotations

import argparse
import sys

import torch

from tritium.backend.engine import LLMEngine
from tritium.backend.sampling_params import SamplingParams
from tritium.client.bench.bench_workload import WorkloadSpec
from tritium.client.bench.workload_profile import run_workload
from tritium.kernels import cpu_native


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("engines", nargs="+", help="engine directories (at least two)")
    p.add_argument("--threads", type=int, default=1, help="torch / OpenMP threads (default 1)")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    if len(args.engines) < 2:
        p.error(f"engines: give at least two engine directories, got {len(args.engines)}")
    for flag, v in (("--threads", args.threads), ("--num-requests", args.num_requests),
                    ("--concurrency", args.concurrency), ("--rounds", args.rounds)):
        if v < 1:
            p.error(f"{flag} must be >= 1, got {v}")
    torch.set_num_threads(args.threads)
    engs = {}
    for d in args.engines:
        eng = LLMEngine(d, enable_prefix_caching=False)
        eng.generate(["warm-up"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        engs[d] = eng
    print(f"path {cpu_native.isa()}, torch threads {torch.get_num_threads()}, {args.num_requests} requests "
          f"at concurrency {args.concurrency}", flush=True)
    spec = WorkloadSpec(num_requests=args.num_requests)
    first = args.engines[0]
    for rnd in range(args.rounds):
        order = list(engs) if rnd % 2 == 0 else list(engs)[::-1]
        rate = {}
        for d in order:
            toks, wall, cpu = run_workload(engs[d], spec, args.concurrency, f"r{rnd}")
            rate[d] = toks / cpu
            print(f"round {rnd} {d}: {toks} tokens, {wall:.1f} s, {cpu:.1f} CPU-s: {toks / wall:.1f} tok/s, "
                  f"{toks / cpu:.1f} tok/CPU-s", flush=True)
        for d in args.engines[1:]:
            print(f"round {rnd} {d} / {first}: {rate[d] / rate[first]:.3f} tok/CPU-s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
