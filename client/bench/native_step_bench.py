"""The native decode step against the per-op path, in-process: a benchmark that prints figures.

    python -m tritium.client.bench.native_step_bench ENGINE_DIR [ENGINE_DIR ...] [--batch 1,4]
        [--tokens 128] [--rounds 3] [--threads N] [--deterministic] [--onednn] [--prefill 256]
        [--native-threads M]

For each engine (an LLMEngine with its scheduler, sampler and KV manager, prefix caching off),
rounds alternate the two paths on the same engine (TRITIUM_NATIVE_STEP=0, then 1, then the other
order next round), each generating --tokens greedy tokens (EOS ignored) for --batch requests at
once after a short prompt; only the steps after the first are timed. Prints the best decode
tokens/s and tokens per CPU-second of each path and the ratio native / per-op. With --onednn an
unquantized bf16 engine gets a third column: the same engine with its K <= 1024 dense GEMMs on
oneDNN (TRITIUM_CPU_ONEDNN=1, so per-op: the native step cannot call oneDNN), interleaved too.
With --prefill N, also prompt tokens/s of --batch requests of N-token prompts scheduled at once
(one token generated each), default engine and the oneDNN one (with --onednn), interleaved.
With --native-threads M, also the native step on M torch threads (one parallel region for the
whole step, kernels/cpu_decode_layer.c), interleaved: tokens/s and per CPU-second of the process
(all its threads), and the wall-clock ratio to the native step on --threads.
With --head (engines with an int6 / int8 head), also the same engine with its LM head on the old
path (TRITIUM_HEAD_DOT=0: codes widened to int8, weight-only), native step on, interleaved, and
the head's own time per call at --batch rows (best of 20 calls per round) on both heads: the
head's share of a native decode step is head ms x steps/s.
--deterministic: the engine option of that name. The memory-bandwidth limit is engine bytes /
bandwidth (--bandwidth-gbs, or a float32 sum measured here, on torch's 4 KiB pages and on 2 MiB
pages as the native step's weights lie: both limits printed): one decode step streams every
weight once.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from tritium.backend.engine import LLMEngine
from tritium.backend.models.native_step import ENV
from tritium.backend.sampling_params import SamplingParams
from tritium.kernels.cpu_linear import HEAD_DOT_ENV, ONEDNN_ENV

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


def _prefill_rate(eng: LLMEngine, prompt_tokens: int, batch: int):
    """Prompt tokens/s (wall, per CPU-second) of `batch` requests of prompt_tokens tokens each."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        ids = [(17 * i + 31 * j) % 1000 + 10 for j in range(prompt_tokens)]
        eng.add_request(f"p{time.monotonic_ns()}-{i}", prompt_token_ids=ids, params=params)
    t0, c0 = time.perf_counter(), time.process_time()
    while eng.has_unfinished():
        eng.step()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return prompt_tokens * batch / wall, prompt_tokens * batch / cpu


def _onednn_engine(path: str, deterministic) -> LLMEngine:
    """The engine with its K <= 1024 dense bf16 GEMMs packed for oneDNN (kernels/cpu_linear.py)."""
    old = os.environ.get(ONEDNN_ENV)
    os.environ[ONEDNN_ENV] = "1"
    try:
        return LLMEngine(path, enable_prefix_caching=False, deterministic=deterministic, max_decode_burst=1)
    finally:
        if old is None:
            os.environ.pop(ONEDNN_ENV, None)
        else:
            os.environ[ONEDNN_ENV] = old


def engine_bytes(path: str) -> int:
    """Bytes of the engine's weight files: what one decode step streams from memory (every
    layer's weights and the LM head; the embedding rows looked up are few)."""
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))


def read_bandwidth_gbs(mib: int = 512, huge: bool = False) -> float:
    """This host's memory read bandwidth with torch's threads: a float32 sum over `mib` MiB, best of 5;
    huge: the buffer on 2 MiB pages (kernels/hugepages.py, as the native step's weights), where the
    host reads about 1.5x faster than on torch's 4 KiB pages (0.0 where it gives none)."""
    x = torch.ones(mib * (1 << 20) // 4)
    if huge:
        from tritium.kernels import hugepages
        moved = hugepages.to_huge_pages([x])
        if moved is None:
            return 0.0
        x = moved[0]
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
    p.add_argument("--deterministic", action="store_true", help="the engine option `deterministic`")
    p.add_argument("--onednn", action="store_true",
                   help="bf16 engines: a third column, the engine with its K <= 1024 GEMMs on oneDNN (per-op)")
    p.add_argument("--prefill", type=int, default=0,
                   help="also time a prefill of --batch prompts of this many tokens (default 0: off)")
    p.add_argument("--native-threads", type=int, default=0,
                   help="also time the native step on this many torch threads (default 0: off)")
    p.add_argument("--head", action="store_true",
                   help="int6 / int8 heads: also the old weight-only head (TRITIUM_HEAD_DOT=0), native step, and head ms per call")
    p.add_argument("--bandwidth-gbs", type=float, default=None,
                   help="host memory bandwidth for the limit column (default: measured, a float32 sum)")
    args = p.parse_args(argv)
    try:
        batches = [int(b) for b in args.batch.split(",")]
        if min(batches) < 1:
            raise ValueError
    except ValueError:
        p.error(f"--batch must be a comma list of integers >= 1, got {args.batch!r}")
    if args.prefill < 0:
        p.error(f"--prefill must be >= 0, got {args.prefill}")
    if args.native_threads < 0:
        p.error(f"--native-threads must be >= 0, got {args.native_threads}")
    if args.threads:
        torch.set_num_threads(args.threads)
    bw = args.bandwidth_gbs or read_bandwidth_gbs()
    bw_huge = 0.0 if args.bandwidth_gbs else read_bandwidth_gbs(huge=True)
    print(f"torch threads {torch.get_num_threads()}, {args.tokens} tokens x {args.rounds} rounds (best); "
          f"memory read bandwidth {bw:.1f} GB/s{' (given)' if args.bandwidth_gbs else ' (measured)'}"
          + (f", {bw_huge:.1f} GB/s on 2 MiB pages" if bw_huge else ""))
    print(f"{'engine':28s} {'batch':>5s} {'per-op tok/s':>12s} {'native tok/s':>12s} {'ratio':>6s} "
          f"{'per-op tok/CPU-s':>16s} {'native tok/CPU-s':>16s} {'ratio':>6s}  oneDNN-engine tok/s, tok/CPU-s; limit")
    old = os.environ.get(ENV)
    try:
        for path in args.engines:
            eng = LLMEngine(path, enable_prefix_caching=False, deterministic=args.deterministic or None,
                            max_decode_burst=1)  # one step a call: per-step figures
            model = eng.runner.model
            _decode_rate(eng, 4, 1)  # warm-up, and NativeStep.get decides
            why = model.__dict__.get("native_step_refusal")
            if why is not None:
                print(f"{path}: the native step does not take this engine: {why}")
                continue
            dflt = None
            if args.onednn and model.cfg.dtype == "bfloat16" and model.cfg.quantization.method == "none":
                dflt = _onednn_engine(path, args.deterministic or None)
                _decode_rate(dflt, 4, 1)
            nbytes = engine_bytes(path)
            limit = f"limit {bw * 1e9 / nbytes:.0f} tok/s ({nbytes / 1e6:.0f} MB)" + (
                f", {bw_huge * 1e9 / nbytes:.0f} on 2 MiB pages" if bw_huge else "")
            for batch in batches:
                best = {"0": (0.0, 0.0), "1": (0.0, 0.0), "d": (0.0, 0.0), "t": (0.0, 0.0)}
                for r in range(args.rounds):
                    for mode in (("0", "1", "d", "t") if r % 2 == 0 else ("t", "d", "1", "0")):
                        if (mode == "d" and dflt is None) or (mode == "t" and not args.native_threads):
                            continue
                        os.environ[ENV] = "0" if mode == "0" else "1"
                        n0 = torch.get_num_threads()
                        if mode == "t":
                            torch.set_num_threads(args.native_threads)
                        try:
                            w, c = _decode_rate(dflt if mode == "d" else eng, args.tokens, batch)
                        finally:
                            torch.set_num_threads(n0)
                        best[mode] = (max(best[mode][0], w), max(best[mode][1], c))
                (w0, c0), (w1, c1) = best["0"], best["1"]
                name = os.path.basename(os.path.normpath(path))[:28]
                print(f"{name:28s} {batch:5d} {w0:12.1f} {w1:12.1f} {w1 / w0:6.2f} {c0:16.1f} {c1:16.1f} "
                      f"{c1 / c0:6.2f}  " + (f"{best['d'][0]:.1f}, {best['d'][1]:.1f}; " if dflt else "") + limit
                      + (f"; native on {args.native_threads} threads {best['t'][0]:.1f} tok/s, {best['t'][1]:.1f} "
                         f"tok/CPU-s, {best['t'][0] / w1:.2f}x native" if args.native_threads else ""),
                      flush=True)
                if args.prefill:
                    _prefill(eng, dflt, args, batch, name)
                if args.head:
                    _head(eng, args, batch, name)
            eng.close()
            if dflt is not None:
                dflt.close()
    finally:
        if old is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = old
    return 0


def _set_head(model, dot: str) -> str:
    """TRITIUM_HEAD_DOT=dot for the model's head, repacked on its next call; returns its kind."""
    os.environ[HEAD_DOT_ENV] = dot
    head = model.lm_head if model.lm_head is not None else model.embed_tokens
    head._packed = None
    return head._get_packed().kind


def _head(eng: LLMEngine, args, batch: int, name: str) -> None:
    """Decode tok/s (native step) with the default head and TRITIUM_HEAD_DOT=0's, interleaved,
    and each head's CPU ms per call at `batch` rows."""
    model = eng.runner.model
    if getattr(model.lm_head or model.embed_tokens, "method", None) not in ("int6", "int8"):
        print(f"{name:28s} {batch:5d} --head: not an int6 / int8 head")
        return
    old = os.environ.get(HEAD_DOT_ENV)
    best = {"1": [0.0, 0.0, float("inf")], "0": [0.0, 0.0, float("inf")]}
    kinds = {}
    h = torch.randn(batch, model.cfg.model.hidden_size).to(model.dtype)
    try:
        os.environ[ENV] = "1"
        for r in range(args.rounds):
            for dot in (("1", "0") if r % 2 == 0 else ("0", "1")):
                kinds[dot] = _set_head(model, dot)
                w, c = _decode_rate(eng, args.tokens, batch)
                model.compute_logits(h)
                c0 = time.process_time()
                for _ in range(20):
                    model.compute_logits(h)
                ms = (time.process_time() - c0) / 20 * 1e3
                b = best[dot]
                best[dot] = [max(b[0], w), max(b[1], c), min(b[2], ms)]
    finally:
        _set_head(model, old or "1")
        if old is None:
            os.environ.pop(HEAD_DOT_ENV, None)
        else:
            os.environ[HEAD_DOT_ENV] = old
    (w1, c1, m1), (w0, c0, m0) = best["1"], best["0"]
    print(f"{name:28s} {batch:5d} head {kinds['1']}: {w1:.1f} tok/s, {c1:.1f} tok/CPU-s, head {m1:.2f} ms "
          f"({m1 * c1 / batch / 10:.0f}% of a step); head {kinds['0']} (TRITIUM_HEAD_DOT=0): {w0:.1f} tok/s, "
          f"{c0:.1f} tok/CPU-s, head {m0:.2f} ms ({m0 * c0 / batch / 10:.0f}%); ratio {c1 / c0:.2f} tok/CPU-s", flush=True)


def _prefill(eng: LLMEngine, onednn, args, batch: int, name: str) -> None:
    """Prompt tokens/s of the engine as it runs (native step on) and of its oneDNN twin, best of
    --rounds, interleaved."""
    best = {"e": (0.0, 0.0), "d": (0.0, 0.0)}
    for r in range(args.rounds):
        for mode in (("e", "d") if r % 2 == 0 else ("d", "e")):
            if mode == "d" and onednn is None:
                continue
            w, c = _prefill_rate(eng if mode == "e" else onednn, args.prefill, batch)
            best[mode] = (max(best[mode][0], w), max(best[mode][1], c))
    line = f"{name:28s} {batch:5d} prefill {args.prefill}-token prompts: {best['e'][0]:.1f} tok/s, {best['e'][1]:.1f} tok/CPU-s"
    if onednn is not None:
        line += (f"; oneDNN engine {best['d'][0]:.1f} tok/s, {best['d'][1]:.1f} tok/CPU-s; "
                 f"ratio {best['e'][0] / best['d'][0]:.2f}, {best['e'][1] / best['d'][1]:.2f}")
    print(line, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
