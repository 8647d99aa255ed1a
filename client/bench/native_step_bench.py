"""The native decode step against the per-op path, in-process: a benchmark that prints figures.

    python -m tritium.client.bench.native_step_bench ENGINE_DIR [ENGINE_DIR ...] [--batch 1,4]
        [--tokens 128] [--rounds 3] [--threads N] [--deterministic]

For each engine (an LLMEngine with its scheduler, sampler and KV manager, prefix caching off),
rounds alternate the two paths on the same engine (TRITIUM_NATIVE_STEP=0, then 1, then the other
order next round), each generating --tokens greedy tokens (EOS ignored) for --batch requests at
once after a short prompt; only the steps after the first are timed. Prints the best decode
tokens/s and tokens per CPU-second of each path and the ratio native / per-op. With
--deterministic every dense bf16 linear is packed for the native GEMM (the native step needs it;
docs/kernels.md), and an unquantized engine gets a third column: the engine as it runs by
default (oneDNN for the dense GEMMs with K <= 1024, per-op), interleaved too. The memory-bandwidth limit is
engine bytes / bandwidth (--bandwidth-gbs, or a float32 sum measured here): one decode step
streams every weight once.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from tritium.backend.engine import LLMEngine
from tritium.backend.models.native_step import ENV
from tritium.backend.sampling_params import SamplingParams

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def _decode_rate(eng: LLMEngine, tokens: int, batch: int):
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        eng.add_request(f"b{time.monotonic_ns()}-{i}", prompt=PROMPT, params=params)
    eng.step()  # the prompt (and first token): not timed
    t0, c0 = time.perf_counter(), time.process_time()
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return steps * batch / wall, steps * batch / cpu


def engine_bytes(path: str) -> int:
    """Bytes of the engine's weight files: what one decode step streams from memory (every
    layer's weights and the LM head; the embedding rows looked up are few)."""
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))


def read_bandwidth_gbs(mib: int = 512) -> float:
    """This host's memory read bandwidth with torch's threads: a float32 sum over `mib` MiB, best of 5."""
    x = torch.ones(mib * (1 << 20) // 4)
    best = float("inf")
    for _ in range(5):
        t0, c0 = time.perf_counter(), time.process_time()
        x.sum()
        # CPU seconds per thread, where that is less than the wall clock: the time another
        # process held this one's core does not count on a shared host
        best = min(best, time.perf_counter() - t0, (time.process_time() - c0) / torch.get_num_threads())
    return x.numel() * 4 / best / 1e9


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("engines", nargs="+")
    p.add_argument("--batch", default="1,4", help="comma list of concurrent requests (default 1,4)")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--deterministic", action="store_true", help="bf16 engines: every dense linear on the native GEMM")
    p.add_argument("--bandwidth-gbs", type=float, default=None,
                   help="host memory bandwidth for the limit column (default: measured, a float32 sum)")
    args = p.parse_args(argv)
    try:
        batches = [int(b) for b in args.batch.split(",")]
        if min(batches) < 1:
            raise ValueError
    except ValueError:
        p.error(f"--batch must be a comma list of integers >= 1, got {args.batch!r}")
    if args.threads:
        torch.set_num_threads(args.threads)
    bw = args.bandwidth_gbs or read_bandwidth_gbs()
    print(f"torch threads {torch.get_num_threads()}, {args.tokens} tokens x {args.rounds} rounds (best); "
          f"memory read bandwidth {bw:.1f} GB/s{' (given)' if args.bandwidth_gbs else ' (measured)'}")
    print(f"{'engine':28s} {'batch':>5s} {'per-op tok/s':>12s} {'native tok/s':>12s} {'ratio':>6s} "
          f"{'per-op tok/CPU-s':>16s} {'native tok/CPU-s':>16s} {'ratio':>6s}  default-engine tok/s, tok/CPU-s; limit")
    old = os.environ.get(ENV)
    try:
        for path in args.engines:
            eng = LLMEngine(path, enable_prefix_caching=False, deterministic=args.deterministic or None)
            model = eng.runner.model
            _decode_rate(eng, 4, 1)  # warm-up, and NativeStep.get decides
            why = model.__dict__.get("native_step_refusal")
            if why is not None:
                print(f"{path}: the native step does not take this engine: {why}")
                continue
            dflt = None
            if args.deterministic and model.cfg.dtype == "bfloat16" and model.cfg.quantization.method == "none":
                dflt = LLMEngine(path, enable_prefix_caching=False, deterministic=False)
                _decode_rate(dflt, 4, 1)
            nbytes = engine_bytes(path)
            limit = f"limit {bw * 1e9 / nbytes:.0f} tok/s ({nbytes / 1e6:.0f} MB)"
            for batch in batches:
                best = {"0": (0.0, 0.0), "1": (0.0, 0.0), "d": (0.0, 0.0)}
                for r in range(args.rounds):
                    for mode in (("0", "1", "d") if r % 2 == 0 else ("d", "1", "0")):
                        if mode == "d" and dflt is None:
                            continue
                        os.environ[ENV] = "1" if mode == "d" else mode
                        w, c = _decode_rate(dflt if mode == "d" else eng, args.tokens, batch)
                        best[mode] = (max(best[mode][0], w), max(best[mode][1], c))
                (w0, c0), (w1, c1) = best["0"], best["1"]
                name = os.path.basename(os.path.normpath(path))[:28]
                print(f"{name:28s} {batch:5d} {w0:12.1f} {w1:12.1f} {w1 / w0:6.2f} {c0:16.1f} {c1:16.1f} "
                      f"{c1 / c0:6.2f}  " + (f"{best['d'][0]:.1f}, {best['d'][1]:.1f}; " if dflt else "") + limit,
                      flush=True)
            eng.close()
            if dflt is not None:
                dflt.close()
    finally:
        if old is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = old
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
