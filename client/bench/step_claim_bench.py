"""The native decode step's work claiming against static shares (or any other setting of the
step read at each step, --knob), in-process: a benchmark that prints figures.

    python -m tritium.client.bench.step_claim_bench ENGINE_DIR [ENGINE_DIR ...] [--batch 1,16]
        [--tokens 64] [--rounds 4] [--threads 2] [--load-ms 1] [--load-period-ms 4]
        [--knob VAR=A,B] [--bandwidth-gbs GBS] [--state-gbs G]

The native step runs on --threads threads in one parallel region (kernels/cpu_decode_layer.c).
Rounds alternate two schedules of its work on the same engine: each GEMM's output channels and
attention's (row, query heads) items claimed from a counter by whichever thread is free
(TRITIUM_STEP_CLAIM=1), and the static shares (the default, TRITIUM_STEP_CLAIM=0: thread i takes the i-th share of each
GEMM, attention rows split by keys to read); both with and without a background load, a process
that keeps one core busy --load-ms of every --load-period-ms (what a server's delivery thread,
tritonserver and client do to a step; 0 turns the loaded half off). The order flips every round.
Each cell: --tokens greedy decode tokens of --batch requests (EOS ignored) after a short prompt,
the steps after the first timed: best and median decode tokens/s over the rounds, and best
tokens per CPU-second of this process (its threads only: the load is another process). Both
schedules give the same bits (tests/test_native_step_threads.py).

--knob VAR=A,B alternates that environment variable's two values instead (default
TRITIUM_STEP_CLAIM=0,1; repeated, A takes every first value and B every second), e.g.
TRITIUM_STEP_PREFETCH=0,256 (the barrier's prefetch of the next GEMM's share, KiB),
TRITIUM_STEP_ATTN_ITEMS=0,1 (a single stream's attention split by query heads under the static
shares), TRITIUM_STEP_SHARE_SPIN=0,1 (the barrier's spin bounded by the share's time); the
header names A and B. Each cell's median tokens/s
is also printed as a share of the memory-bandwidth limit: engine bytes / the 2-thread read
bandwidth on 2 MiB pages (--bandwidth-gbs, or measured here as native_step_bench does).

--state-gbs G: for a host whose memory bandwidth flips between states every few seconds, each
pair of rounds (A then B, or B then A, back to back) is bracketed by a 2-thread read of 128 MiB on
2 MiB pages (step_profile.read_probe), and the pairs are reported per state of those two reads:
"fast" (both >= G), "slow" (both in [G / 2, G)), "contended" (one < G / 2: other processes on the
memory bus), mixed pairs dropped; per state the pair count, the median tokens/s of A and B, the
median of the pairs' B / A ratios and the median read, and from every step of those rounds the
10th percentile of A's and B's step times (a contended host preempts some steps: the fast tail is
what the step does when it has its cores) and their ratio A / B. Use many short rounds (e.g.
--rounds 60 --tokens 8), no load (--load-ms 0).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from tritium.backend.engine import LLMEngine
from tritium.backend.models.native_step import ENV
from tritium.backend.sampling_params import SamplingParams
from tritium.client.bench.bg_load import Load
from tritium.client.bench.native_step_bench import PROMPT, _decode_rate, engine_bytes, read_bandwidth_gbs
from tritium.client.bench.step_profile import read_probe

CLAIM_ENV = "TRITIUM_STEP_CLAIM"

def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("engines", nargs="+")
    p.add_argument("--batch", default="1,16", help="comma list of concurrent requests (default 1,16)")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--threads", type=int, default=2, help="threads of the native step (default 2)")
    p.add_argument("--load-ms", type=float, default=1.0, help="background load: busy ms per period (0: no loaded runs)")
    p.add_argument("--load-period-ms", type=float, default=4.0)
    p.add_argument("--knob", action="append", default=None,
                   help=f"VAR=A,B: the two settings alternated (repeatable: A sets every first value; default {CLAIM_ENV}=0,1)")
    p.add_argument("--bandwidth-gbs", type=float, default=None, help="2 MiB-page read bandwidth (default: measured)")
    p.add_argument("--state-gbs", type=float, default=None,
                   help="split pairs of rounds by a same-second 2-thread read at this many GB/s (fast / slow)")
    args = p.parse_args(argv)
    if args.state_gbs is not None and not args.state_gbs > 0:
        p.error(f"--state-gbs must be > 0, got {args.state_gbs}")
    knobs = {}
    for k in args.knob or [f"{CLAIM_ENV}=0,1"]:
        var, _, vals = k.partition("=")
        knobs[var] = tuple(vals.split(","))
        if not var.startswith("TRITIUM_") or len(knobs[var]) != 2 or not all(knobs[var]):
            p.error(f"--knob must be TRITIUM_VAR=A,B (two values), got {k!r}")
    modes = ("A", "B")
    try:
        batches = [int(b) for b in args.batch.split(",")]
        if min(batches) < 1:
            raise ValueError
    except ValueError:
        p.error(f"--batch must be a comma list of integers >= 1, got {args.batch!r}")
    if args.threads < 2:
        p.error(f"--threads must be >= 2 (one thread has no shares to schedule), got {args.threads}")
    if not 0 <= args.load_ms <= args.load_period_ms or args.load_period_ms <= 0:
        p.error("--load-ms must be in [0, --load-period-ms] and --load-period-ms > 0")
    torch.set_num_threads(args.threads)
    old = {k: os.environ.get(k) for k in (ENV, CLAIM_ENV, *knobs)}
    os.environ[ENV] = "1"
    loads = (False, True) if args.load_ms > 0 else (False,)
    bw = args.bandwidth_gbs or read_bandwidth_gbs(huge=True)
    print(f"native step on {args.threads} threads, {args.tokens} tokens x {args.rounds} rounds; load: one core busy "
          f"{args.load_ms:g} ms of every {args.load_period_ms:g} ms; "
          f"A: {' '.join(f'{k}={v[0]}' for k, v in knobs.items())}, B: {' '.join(f'{k}={v[1]}' for k, v in knobs.items())}; "
          f"2 MiB-page read bandwidth {bw:.1f} GB/s")
    print(f"{'engine':20s} {'batch':>5s} {'load':>4s} {'A tok/s best/med':>22s} {'B tok/s best/med':>21s} "
          f"{'B/A':>6s} {'A tok/CPU-s':>16s} {'B tok/CPU-s':>15s} {'B/A':>6s} {'A limit':>7s} {'B limit':>7s}")
    probe = read_probe() if args.state_gbs else None
    try:
        for path in args.engines:
            eng = LLMEngine(path, enable_prefix_caching=False, max_decode_burst=1)  # one step a call
            _decode_rate(eng, 4, 1)
            why = eng.runner.model.__dict__.get("native_step_refusal")
            if why is not None:
                print(f"{path}: the native step does not take this engine: {why}")
                continue
            name = os.path.basename(os.path.normpath(path))[:20]
            limit = bw * 1e9 / engine_bytes(path)  # tokens/s of one stream at the bandwidth limit
            for batch in batches:
                runs = {(m, ld): [] for m in modes for ld in loads}
                reads = {ld: [] for ld in loads}  # per pair: the same-second reads before and after it
                for r in range(args.rounds):
                    for ld in (loads if r % 2 == 0 else loads[::-1]):
                        with Load(args.load_ms if ld else 0, args.load_period_ms):
                            b0 = probe() if probe else 0.0
                            for mode in (modes if r % 2 == 0 else modes[::-1]):
                                for var, vals in knobs.items():
                                    os.environ[var] = vals[modes.index(mode)]
                                runs[(mode, ld)].append(_decode_rate(eng, args.tokens, batch) if not probe else
                                                        _step_times(eng, args.tokens, batch))
                            if probe:
                                reads[ld].append((b0, probe()))
                if probe:
                    _by_state(name, batch, runs, reads, loads, modes, args.state_gbs)
                    continue
                for ld in loads:
                    s, c = runs[(modes[0], ld)], runs[(modes[1], ld)]
                    sw, cw = [w for w, _ in s], [w for w, _ in c]
                    scpu, ccpu = max(x for _, x in s), max(x for _, x in c)
                    print(f"{name:20s} {batch:5d} {'on' if ld else 'off':>4s} {max(sw):11.1f} / {statistics.median(sw):7.1f}"
                          f" {max(cw):10.1f} / {statistics.median(cw):7.1f} {statistics.median(cw) / statistics.median(sw):6.2f}"
                          f" {scpu:16.1f} {ccpu:15.1f} {ccpu / scpu:6.2f}"
                          f" {statistics.median(sw) / batch / limit:6.0%} {statistics.median(cw) / batch / limit:6.0%}",
                          flush=True)
            print(f"{name}: {engine_bytes(path) / 1e6:.0f} MB of weights per step")
            eng.close()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return 0


def _step_times(eng: LLMEngine, tokens: int, batch: int):
    """(decode tokens/s, [each decode step's seconds]) of `batch` greedy requests of `tokens` tokens."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        eng.add_request(f"s{time.monotonic_ns()}-{i}", prompt=PROMPT, params=params)
    eng.step()  # the prompt (and first token): not timed
    steps = []
    while eng.has_unfinished():
        t = time.perf_counter()
        eng.step()
        steps.append(time.perf_counter() - t)
    return len(steps) * batch / sum(steps), steps


def _p10(xs) -> float:
    return sorted(xs)[(len(xs) - 1) // 10]


def _by_state(name, batch, runs, reads, loads, modes, g) -> None:
    """One row per load and host state of the pairs (see --state-gbs)."""
    for ld in loads:
        states = {"fast": [], "slow": [], "contended": []}
        for i, (b0, b1) in enumerate(reads[ld]):
            lo, hi = min(b0, b1), max(b0, b1)
            state = "fast" if lo >= g else "slow" if hi < g and lo >= g / 2 else "contended" if lo < g / 2 else None
            if state:
                ra, rb = runs[(modes[0], ld)][i], runs[(modes[1], ld)][i]
                states[state].append((ra[0], rb[0], (b0 + b1) / 2, ra[1], rb[1]))
        for state, pairs in states.items():
            if not pairs:
                continue
            a, b, rd = ([x[j] for x in pairs] for j in range(3))
            ratio = statistics.median(x[1] / x[0] for x in pairs)
            sa, sb = _p10([t for x in pairs for t in x[3]]), _p10([t for x in pairs for t in x[4]])
            print(f"{name:20s} {batch:5d} {'on' if ld else 'off':>4s} {state:>9s} {len(pairs):3d} pairs: "
                  f"A {statistics.median(a):7.1f} B {statistics.median(b):7.1f} tok/s, B/A {ratio:5.3f} "
                  f"(read {statistics.median(rd):5.1f} GB/s); step p10 A {sa * 1e3:.3f} B {sb * 1e3:.3f} ms, "
                  f"A/B {sa / sb:5.3f}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
