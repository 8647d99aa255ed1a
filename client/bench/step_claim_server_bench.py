"""The native decode step's work claiming against static shares THROUGH the server: a benchmark
that prints figures.

    python -m tritium.client.bench.step_claim_server_bench ENGINE_DIR [LABEL=ENGINE_DIR ...]
        [--small-step-threads 2,auto] [--rounds 3] [--single-stream 3] [--tokens 128]

Starts TWO tritonservers side by side, both serving every engine once per --small-step-threads
value (`auto`: the server's tuned default, backend/thread_policy.py): one with
TRITIUM_STEP_CLAIM=1 in its environment (GEMM channels and attention items claimed by whichever
thread is free), one with TRITIUM_STEP_CLAIM=0 (the static shares, the default: thread i takes the i-th share of every op, one-row
attention on one thread, the barrier's spin not bounded by the piece just taken). Rounds run
`tritium bench`'s single streams (--single-stream requests of --tokens tokens after a 12-word
prompt, one at a time) on every model of both servers, interleaved, the starting order flipped
each round. Prints output tok/s per round, the median, and claimed / static per engine and value.
Both servers compete for the same cores, as a server's own threads do: read the ratios.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile

from tritium.builder.repository import write_repository
from tritium.client.bench.bench_drivers import TritonGrpcDriver
from tritium.client.bench.bench_suite import SuiteOptions, run_suite
from tritium.client.bench.bench_workload import WorkloadSpec
from tritium.client.bench.threads_bench import _engines, _int_list
from tritium.client.serve.server import TritonServer

CLAIM_ENV = "TRITIUM_STEP_CLAIM"


def _start(repo: str, names: list, claim: str) -> TritonServer:
    old = os.environ.get(CLAIM_ENV)
    os.environ[CLAIM_ENV] = claim  # server_env() copies the environment at start()
    try:
        srv = TritonServer(repo, log_file=os.path.join(repo, f"tritonserver-claim{claim}.log"), load_models=names)
        srv.start(timeout=600)
        return srv
    finally:
        if old is None:
            os.environ.pop(CLAIM_ENV, None)
        else:
            os.environ[CLAIM_ENV] = old


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("engines", nargs="+", help="ENGINE_DIR or LABEL=ENGINE_DIR")
    p.add_argument("--small-step-threads", default="2,auto", help="values served (default 2,auto)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--single-stream", type=int, default=3)
    p.add_argument("--tokens", type=int, default=128)
    a = p.parse_args(argv)
    values = _int_list(a.small_step_threads, "--small-step-threads", auto=True)
    if a.rounds < 1 or a.single_stream < 1 or a.tokens < 1:
        raise SystemExit("--rounds, --single-stream and --tokens must be >= 1")
    engines = _engines(a.engines)
    repo = tempfile.mkdtemp(prefix="tritium-claim-bench-")
    names = []
    for label, eng in engines.items():
        for t in values:
            params = {"enable_prefix_caching": False}
            if t != "auto":
                params["small_step_threads"] = t
            write_repository(repo, f"{label}_t{t}", eng, engine_params=params)
            names.append(f"{label}_t{t}")
    print(f"TRITIUM_CPU_ISA={os.environ.get('TRITIUM_CPU_ISA', '(best)')} cores={os.cpu_count()} "
          f"load={os.getloadavg()[0]:.2f}", file=sys.stderr)
    servers = {}
    try:
        servers["static"] = _start(repo, names, "0")
        servers["claim"] = _start(repo, names, "1")
        targets = {f"{n}_{k}": TritonGrpcDriver(srv.grpc_url, n) for n in names for k, srv in servers.items()}
        for d in targets.values():
            d.check()
        opts = SuiteOptions(WorkloadSpec(2, (12, 24), (16, 32), 0), [], None, a.single_stream, 12, a.tokens, 1,
                            progress=False)
        rates = {t: [] for t in targets}
        for r in range(a.rounds):
            result, _ = run_suite(targets, dataclasses.replace(opts, tag=f"r{r}"), order_offset=r)
            for t, runs in result["runs"].items():
                rates[t] += [run["output_tok_s"] for run in runs]
    finally:
        for srv in servers.values():
            srv.stop()
    print(f"load after {os.getloadavg()[0]:.2f}", file=sys.stderr)
    print(f"{'model':<16}{'static tok/s per round':>34}{'claim tok/s per round':>34}"
          f"{'static med':>11}{'claim med':>10}{'ratio':>7}")
    for n in names:
        s, c = rates[f"{n}_static"], rates[f"{n}_claim"]
        ms, mc = statistics.median(s), statistics.median(c)
        print(f"{n:<16}{' / '.join(f'{v:.1f}' for v in s):>34}{' / '.join(f'{v:.1f}' for v in c):>34}"
              f"{ms:11.1f}{mc:10.1f}{mc / ms:7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
