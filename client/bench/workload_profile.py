"""Where the serving workload's time goes, in-process: a benchmark that prints figures.

    python -m tritium.client.bench.workload_profile ENGINE_DIR [--threads 1] [--num-requests 32]
        [--concurrency 16] [--rounds 1] [--base-kernels DIR] [--budgets N,N...] [--no-split] [--load W/P]

Runs `tritium bench`'s workload (bench_workload.make_requests: seeded prompts of 12-384 words,
16-256 output tokens, EOS ignored) on an LLMEngine in this process, keeping --concurrency requests
in flight (a finished request's slot goes to the next one, as the benchmark's clients do), and
prints output tokens/s and tokens per CPU-second of the process. With the split on (default), each
op's CPU seconds are counted on the Python side, by what it is: the dense GEMMs by shape and rows
per step, paged attention by rows per step, the native decode step (steps of at most 32 rows, one
native call: its GEMMs and attention together), the LM head, the glue ops, sampling, the rest of
the runner and of the engine's step (scheduling, detokenizing). Nested timers count once (a child's
time is not its parent's).

--base-kernels DIR: also run the engine with the native kernels compiled from DIR (a directory
with another revision's kernels/*.c and *.h, e.g. `git archive main kernels | tar -x`), alternating
with this tree's kernels round by round (this tree first on even rounds, DIR first on odd ones),
each round on new prompt text; the ratio this tree / DIR is printed per round. The host's
instruction-set path follows TRITIUM_CPU_ISA as everywhere.

--budgets N,N...: run every round once per step token budget (the scheduler's
max_num_batched_tokens: how many prompt tokens a step takes beside the decodes), in turn (reversed
on odd rounds), on one engine; the budget is printed with each run. Default: the engine's (2048).

--load W/P: a background process busy W ms of every P ms runs during the workload (as the server's
delivery thread, tritonserver and the client take a core for a moment; bg_load.Load).
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time
from typing import Callable, Dict

import torch

from tritium.backend import engine as engine_mod
from tritium.backend import quant
from tritium.backend import model_runner
from tritium.backend.engine import LLMEngine
from tritium.backend.models import decoder, linear, native_step
from tritium.backend.sampling_params import SamplingParams
from tritium.client.bench.bench_workload import WorkloadSpec, make_requests
from tritium.client.bench.bg_load import Load, parse_load
from tritium.kernels import cpu_native, ops


class OpTimer:
    """CPU seconds per key; a nested timer's time is taken out of its parent's."""

    def __init__(self):
        self.secs: Dict[str, float] = collections.defaultdict(float)
        self.calls: Dict[str, int] = collections.defaultdict(int)
        self._stack = []

    def wrap(self, fn: Callable, key: Callable) -> Callable:
        def timed(*args, **kwargs):
            k = key(*args, **kwargs)
            t0 = time.process_time()
            self._stack.append(0.0)
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.process_time() - t0
                child = self._stack.pop()
                self.secs[k] += dt - child
                self.calls[k] += 1
                if self._stack:
                    self._stack[-1] += dt
        timed.__wrapped__ = fn
        return timed

    def reset(self) -> None:
        self.secs.clear()
        self.calls.clear()


def rows_class(n: int) -> str:
    return "1" if n == 1 else "2-32" if n <= 32 else "33-256" if n <= 256 else ">256"


def install(timer: OpTimer) -> None:
    """Wrap the ops the split counts (once per process)."""
    rc = lambda x: rows_class(x.shape[0])  # noqa: E731
    dl = linear.DenseLinear
    dl.forward = timer.wrap(dl.forward, lambda self, x: f"GEMM {self.out_features}x{self.in_features}, rows {rc(x)}")
    # quantized linears (int8 / int4 engines: the integer-dot GEMMs); the LM head's own call counts as the head
    ql = quant._QuantLinearBase
    q_cpu = ql._cpu
    q_timed = timer.wrap(q_cpu, lambda self, x: f"GEMM {self.out_features}x{self.in_features}, "
                                                f"rows {rc(x.reshape(-1, x.shape[-1]))}")
    ql._cpu = lambda self, x: q_cpu(self, x) if self.is_head else q_timed(self, x)
    ops.paged_attention = timer.wrap(ops.paged_attention, lambda q, *a, **k: f"attention, rows {rc(q)}")
    for name in ("rms_norm", "silu_mul", "rotary_kv_write", "kv_write", "rotary"):
        setattr(ops, name, timer.wrap(getattr(ops, name), lambda *a, name=name, **k: f"glue {name}"))
    lm = decoder.DecoderLM
    lm.compute_logits = timer.wrap(lm.compute_logits, lambda self, h: f"LM head, rows {rc(h)}")
    lm.embed = timer.wrap(lm.embed, lambda self, ids: "embedding")
    ns = native_step.NativeStep
    ns.run = timer.wrap(ns.run, lambda self, h, *a: f"native decode step, rows {rc(h)}")
    # the whole step in one call (embedding, layers, final norm; with logits=True the LM head too)
    ns.run_step = timer.wrap(ns.run_step, lambda self, model, ids, *a, logits=False, **k:
                             f"native decode step{' + LM head' if logits else ''}, rows {rc(ids)}")
    mr = model_runner.ModelRunner
    mr.sample = timer.wrap(mr.sample, lambda *a: "sampling")
    mr.execute = timer.wrap(mr.execute, lambda *a: "runner, other")
    en = engine_mod.LLMEngine
    en.step = timer.wrap(en.step, lambda *a: "engine step, other (scheduling, outputs)")


OPTIONAL_SRCS = ("cpu_i8dot_peak.c",)  # sources a base revision may lack (benchmark probes)


def base_lib(base_dir: str):
    """The native kernels compiled from base_dir's sources (same file names as this tree's)."""
    srcs, hdrs = cpu_native._SRCS, cpu_native._HEADERS
    names = [os.path.basename(p) for p in srcs]
    # a benchmark probe (no kernel the bindings name) that an older revision lacks is left out
    names = [n for n in names if n not in OPTIONAL_SRCS or os.path.exists(os.path.join(base_dir, n))]
    missing = [n for n in names if not os.path.exists(os.path.join(base_dir, n))]
    if missing:
        raise SystemExit(f"--base-kernels {base_dir}: missing {', '.join(missing)}")
    cpu_native._SRCS = [os.path.join(base_dir, n) for n in names]
    cpu_native._HEADERS = [os.path.join(base_dir, os.path.basename(h)) for h in hdrs
                           if os.path.exists(os.path.join(base_dir, os.path.basename(h)))]
    try:
        return cpu_native._lib.__wrapped__()
    finally:
        cpu_native._SRCS, cpu_native._HEADERS = srcs, hdrs


def run_workload(eng: LLMEngine, spec: WorkloadSpec, concurrency: int, tag: str):
    """(output tokens, wall s, CPU s) of the workload at `concurrency` requests in flight."""
    reqs = make_requests(spec, tag)
    pending, live = list(reqs), 0
    t0, c0 = time.perf_counter(), time.process_time()
    while pending or eng.has_unfinished():
        while pending and live < concurrency:
            r = pending.pop(0)
            eng.add_request(f"{tag}-{r.index}", prompt=r.prompt,
                            params=SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True))
            live += 1
        live -= sum(1 for o in eng.step() if o.finished)
    return sum(r.max_tokens for r in reqs), time.perf_counter() - t0, time.process_time() - c0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("engine")
    p.add_argument("--threads", type=int, default=1, help="torch / OpenMP threads (default 1)")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--base-kernels", default=None, help="a directory of another revision's kernels/*.c, *.h")
    p.add_argument("--no-split", action="store_true", help="no per-op timers (tok/s only)")
    p.add_argument("--load", type=parse_load, default=None,
                   help="W/P: a background process busy W ms of every P ms during the workload")
    p.add_argument("--budgets", default=None,
                   help="comma-separated step token budgets (max_num_batched_tokens) to alternate, e.g. 512,2048")
    args = p.parse_args(argv)
    budgets = [None]
    if args.budgets is not None:
        try:
            budgets = [int(b) for b in args.budgets.split(",")]
        except ValueError:
            budgets = [0]
        if not budgets or min(budgets) < 1:
            p.error(f"--budgets: comma-separated integers >= 1, got {args.budgets!r}")
    for flag, v in (("--threads", args.threads), ("--num-requests", args.num_requests),
                    ("--concurrency", args.concurrency), ("--rounds", args.rounds)):
        if v < 1:
            p.error(f"{flag} must be >= 1, got {v}")
    if args.base_kernels is not None and args.budgets is not None:
        p.error("--budgets and --base-kernels: one comparison at a time")
    if args.base_kernels is not None and not os.path.isdir(args.base_kernels):
        p.error(f"--base-kernels: {args.base_kernels!r} is not a directory")
    torch.set_num_threads(args.threads)
    if not cpu_native.available():
        p.error("the native CPU kernels are off or unavailable here (TRITIUM_NATIVE_CPU=0, or no compiler)")
    libs = {"this tree": cpu_native._lib()}
    if args.base_kernels:
        libs["base"] = base_lib(args.base_kernels)
    current = {"lib": "this tree"}
    original = cpu_native._lib
    cpu_native._lib = lambda: libs[current["lib"]]  # every kernel call looks the library up here
    timer = OpTimer()
    if not args.no_split:
        install(timer)
    try:
        eng = LLMEngine(args.engine, enable_prefix_caching=False)
        eng.generate(["warm-up"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        load = f", background load {args.load[0]:g} ms of every {args.load[1]:g} ms" if args.load else ""
        print(f"path {cpu_native.isa()}, torch threads {torch.get_num_threads()}, {args.num_requests} requests "
              f"at concurrency {args.concurrency}{load}", flush=True)
        spec = WorkloadSpec(num_requests=args.num_requests)
        for rnd in range(args.rounds):
            order = list(libs) if rnd % 2 == 0 else list(libs)[::-1]
            rates = {}
            for name, budget in [(n, b) for n in order for b in (budgets if rnd % 2 == 0 else budgets[::-1])]:
                current["lib"] = name
                if budget is not None:
                    eng.scheduler.max_num_batched_tokens = budget
                timer.reset()
                with Load(*(args.load or (0.0, 1.0))):
                    toks, wall, cpu = run_workload(eng, spec, args.concurrency, f"r{rnd}{name[0]}{budget or ''}")
                rates[name] = (toks / wall, toks / cpu)
                tb = "" if budget is None else f", budget {budget}"
                print(f"round {rnd} kernels {name}{tb}: {toks} tokens, {wall:.1f} s, {cpu:.1f} CPU-s: "
                      f"{toks / wall:.1f} tok/s, {toks / cpu:.1f} tok/CPU-s", flush=True)
                for key, secs in sorted(timer.secs.items(), key=lambda kv: -kv[1]):
                    print(f"    {key:48s} {secs:8.2f} CPU-s {100 * secs / cpu:5.1f} %  ({timer.calls[key]} calls)")
            if len(rates) == 2:
                (w1, c1), (w0, c0) = rates["this tree"], rates["base"]
                print(f"round {rnd} this tree / base: {w1 / w0:.3f} tok/s, {c1 / c0:.3f} tok/CPU-s", flush=True)
    finally:
        cpu_native._lib = original
    return 0


if __name__ == "__main__":
    sys.exit(main())
