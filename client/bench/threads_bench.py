"""Small-step threads through one tritonserver: a benchmark that prints figures.

    python -m tritium.client.bench.threads_bench ENGINE_DIR [LABEL=ENGINE_DIR ...]
        [--small-step-threads 1,2] [--rounds 2] [--single-stream 3] [--tokens 128] [--concurrency 1]
        [--json]

The engine option `small_step_threads` (backend/thread_policy.py: torch threads, and so native
decode step threads, of steps of fewer than 4 tokens) decides single-stream speed on a few
cores. This starts ONE tritonserver (`TRITIUM_CPU_ISA` and `OMP_WAIT_POLICY` pass through from
the environment, as `tritium serve` sets them) serving every engine once per value, e.g.
`bf16_t1` and `bf16_t2`, and runs `tritium bench`'s suite over all of them in one run,
interleaved, the starting order flipped each round (`auto`: no parameter, the
server's default, ThreadPolicy's measured choice): a short run at --concurrency (2 requests of
12-24 words, 16-32 tokens) and --single-stream requests of --tokens tokens, one at a time. It
prints output tok/s per round and the ratio of each value to the first, per engine.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile

from tritium.builder.repository import write_repository
from tritium.client.bench.bench_drivers import TritonGrpcDriver
from tritium.client.bench.bench_suite import SuiteOptions, run_suite
from tritium.client.bench.bench_workload import WorkloadSpec
from tritium.client.serve.server import TritonServer


def _int_list(text: str, flag: str, auto: bool = False) -> list:
    try:
        vals = [v if auto and v == "auto" else int(v) for v in text.split(",") if v]
    except ValueError:
        vals = []
    if not vals or any(v != "auto" and v < 1 for v in vals):
        allowed = "integers >= 1 or auto" if auto else "integers >= 1"
        raise SystemExit(f"{flag}: a comma list of {allowed}, got {text!r}")
    return vals


def _engines(args: list) -> dict:
    out = {}
    for a in args:
        label, _, path = a.rpartition("=")
        label = label or os.path.basename(os.path.normpath(path))
        if not os.path.isfile(os.path.join(path, "engine.json")):
            raise SystemExit(f"engine {path!r}: no engine.json there (ENGINE_DIR or LABEL=ENGINE_DIR)")
        if not label.replace("_", "").isalnum() or label in out:
            raise SystemExit(f"engine label {label!r}: letters, digits and _ only, each label once")
        out[label] = os.path.abspath(path)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("engines", nargs="+", help="ENGINE_DIR or LABEL=ENGINE_DIR")
    p.add_argument("--small-step-threads", default="1,2,auto",
                   help="values to compare; auto = the server's default, tuned while serving (default 1,2,auto)")
    p.add_argument("--rounds", type=int, default=2, help="suite repetitions, order flipped each (default 2)")
    p.add_argument("--single-stream", type=int, default=3, help="single-stream requests per round (default 3)")
    p.add_argument("--tokens", type=int, default=128, help="output tokens of each single stream (default 128)")
    p.add_argument("--concurrency", default="1", help="concurrency of the short run (default 1)")
    p.add_argument("--json", action="store_true", help="print every round's result as JSON lines")
    a = p.parse_args(argv)
    values = _int_list(a.small_step_threads, "--small-step-threads", auto=True)
    conc = _int_list(a.concurrency, "--concurrency")
    if a.rounds < 1 or a.single_stream < 1 or a.tokens < 1:
        raise SystemExit("--rounds, --single-stream and --tokens must be >= 1")
    engines = _engines(a.engines)
    repo = tempfile.mkdtemp(prefix="tritium-threads-bench-")
    names = []
    for label, eng in engines.items():
        for t in values:
            name = f"{label}_t{t}"
            params = {"enable_prefix_caching": False}
            if t != "auto":  # auto: the server's default, measured while serving (ThreadPolicy)
                params["small_step_threads"] = t
            write_repository(repo, name, eng, engine_params=params)
            names.append(name)
    print(f"TRITIUM_CPU_ISA={os.environ.get('TRITIUM_CPU_ISA', '(best)')} cores={os.cpu_count()} "
          f"load={os.getloadavg()[0]:.2f}", file=sys.stderr)
    server = TritonServer(repo, log_file=os.path.join(repo, "tritonserver.log"), load_models=names)
    server.start(timeout=600)
    rates = {n: {} for n in names}
    targets = {}
    try:
        targets = {n: TritonGrpcDriver(server.grpc_url, n) for n in names}
        for d in targets.values():
            d.check()
        opts = SuiteOptions(WorkloadSpec(2, (12, 24), (16, 32), 0), conc, None, a.single_stream, 12, a.tokens, 1,
                            progress=False)
        for r in range(a.rounds):
            result, _ = run_suite(targets, dataclasses.replace(opts, tag=f"r{r}"), order_offset=r)
            if a.json:
                print(json.dumps(result, default=str), flush=True)
            for n, runs in result["runs"].items():
                for run in runs:
                    rates[n].setdefault(run["label"], []).append(run["output_tok_s"])
    finally:
        for d in targets.values():  # each driver's gRPC stream
            d.close()
        server.stop()
    print(f"load after {os.getloadavg()[0]:.2f}", file=sys.stderr)
    labels = list(next(iter(rates.values())))
    print(f"{'model':<24}" + "".join(f"{lab + ' tok/s per round':>34}" for lab in labels)
          + "".join(f"{'ratio ' + lab:>14}" for lab in labels))
    for label in engines:
        base = {lab: sum(rates[f"{label}_t{values[0]}"][lab]) for lab in labels}
        for t in values:
            n = f"{label}_t{t}"
            cells = "".join(f"{' / '.join(f'{v:.1f}' for v in rates[n][lab]):>34}" for lab in labels)
            ratios = "".join(f"{sum(rates[n][lab]) / base[lab]:>14.2f}" for lab in labels)
            print(f"{n:<24}{cells}{ratios}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
