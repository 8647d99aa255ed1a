"""One benchmark suite over one or more systems: warm-up, the workload at each concurrency (or
Poisson arrivals), then the single-stream run; systems interleaved run by run.

Interleaving: every run (one concurrency level, or the single stream) is measured on every
system before the next run starts, and the order of the systems flips from one run to the next
(A B, B A, ...), so a host that speeds up or slows down during the suite does not favour one.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Tuple

from tritium.client.bench.bench_report import ratio, summarize
from tritium.client.bench.bench_runner import RunResult, run_requests
from tritium.client.bench.bench_workload import WorkloadSpec, make_requests, single_stream_requests


@dataclass
class SuiteOptions:
    """What to run (defaults: the standard workload, 32 requests at concurrency 16, and 3 single streams)."""
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    concurrencies: List[int] = field(default_factory=lambda: [16])  # one run per level
    request_rate: Optional[float] = None   # Poisson arrivals per second; None = all requests at once
    single_stream: int = 3                 # requests sent one at a time after the workload (0 = none)
    single_stream_words: int = 12          # prompt words of those (about 16 SmolLM2 tokens)
    single_stream_tokens: int = 128        # output tokens of those
    warmup: int = 2                        # unmeasured short requests per system first
    tag: str = ""                          # mixed into prompt text: distinct tags share no prompt text
    client_nice: int = 0                   # the benchmark's client threads at this nice value (0: as started)
    progress: bool = True

    def validate(self) -> None:
        self.workload.validate()
        if self.single_stream < 0:
            raise ValueError(f"--single-stream must be >= 0, got {self.single_stream}")
        if self.single_stream and not (self.single_stream_words >= 2 and self.single_stream_tokens >= 1):
            raise ValueError("--single-stream-words must be >= 2 and --single-stream-tokens >= 1")
        if self.request_rate is not None and not self.request_rate > 0:
            raise ValueError(f"--request-rate must be > 0 requests/s, got {self.request_rate}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {self.warmup}")
        if not 0 <= self.client_nice <= 19:
            raise ValueError(f"--client-nice must be in [0, 19], got {self.client_nice}")


def warm_up(name: str, driver, n: int, tag: str, client_nice: int = 0) -> None:
    """n short requests, one at a time, not measured (connections, allocator, first-call costs)."""
    if n:
        reqs = single_stream_requests(n, num_words=8, max_tokens=8, seed=12345, tag=f"warm{tag}")
        res = run_requests(driver, reqs, 1, "warmup", progress=False, client_nice=client_nice)
        bad = [r.error for r in res.results if not r.ok]
        if bad:
            raise OSError(f"{name}: warm-up request failed: {bad[0]}")


def run_suite(targets: Dict[str, object], opts: SuiteOptions, order_offset: int = 0, probe=None
              ) -> Tuple[dict, Dict[str, List[RunResult]]]:
    """Run the suite on every {name: driver}; returns (JSON-ready result, raw runs per system).

    order_offset flips the starting order (the side-by-side script alternates it between pairs).
    probe (bandwidth_probe.ReadProbe): the host's read just before and after each single-stream
    request of every system (run_requests).
    """
    opts.validate()
    names = list(targets)
    for name in names:
        warm_up(name, targets[name], opts.warmup, opts.tag, opts.client_nice)
    plan: List[Tuple[str, list, int, Optional[float]]] = []
    for i, c in enumerate(opts.concurrencies):
        label = f"c{c}" if opts.request_rate is None else f"r{opts.request_rate:g}c{c}"
        plan.append((label, make_requests(opts.workload, tag=f"{opts.tag}w{i}"), c, opts.request_rate))
    if opts.single_stream:
        plan.append(("single", single_stream_requests(opts.single_stream, opts.single_stream_words,
                                                      opts.single_stream_tokens, opts.workload.seed,
                                                      tag=f"{opts.tag}s"), 1, None))
    raw: Dict[str, List[RunResult]] = {n: [] for n in names}
    for k, (label, reqs, conc, rate) in enumerate(plan):
        order = names if (k + order_offset) % 2 == 0 else names[::-1]
        for name in order:
            raw[name].append(run_requests(targets[name], reqs, conc, label, rate, opts.workload.seed,
                                          opts.progress, desc=f"{name} {label}", client_nice=opts.client_nice,
                                          probe=probe if label == "single" else None))
    summaries = {n: [summarize(r) for r in raw[n]] for n in names}
    result = {"workload": {**asdict(opts.workload), "concurrency": opts.concurrencies,
                           "request_rate": opts.request_rate, "single_stream": opts.single_stream,
                           "single_stream_words": opts.single_stream_words,
                           "single_stream_tokens": opts.single_stream_tokens, "warmup": opts.warmup,
                           "client_nice": opts.client_nice},
              "systems": {n: targets[n].describe() for n in names},
              "runs": summaries, "ratios": ratios(summaries)}
    return result, raw


def ratios(summaries: Dict[str, List[dict]]) -> dict:
    """Output tok/s of each system / the reference's, per run label. The reference is the
    in-process engine when it ran (so a server's ratio is its overhead), else the first system."""
    names = list(summaries)
    if len(names) < 2:
        return {}
    ref = "in-process" if "in-process" in summaries else names[0]
    by_label = {n: {s["label"]: s for s in summaries[n]} for n in names}
    out = {"reference": ref}
    for n in names:
        if n != ref:
            out[n] = {label: ratio(s, by_label[ref].get(label)) for label, s in by_label[n].items()}
    return out
