"""Where a served token's CPU goes: per-thread CPU of tritonserver, the model's backend stub and
this client, in ms per output token: over single streams, or (`--concurrency N`) over the serving
benchmark's default workload (32 requests, prompts of 12-384 words, 16-256 tokens) at N in
flight, optionally against the same engine in this process (`--engine`). A benchmark that
prints figures.

On a 2-core host the engine step runs on both cores, so every CPU-microsecond that the stub's
delivery and housekeeping threads, tritonserver and the client spend per token is taken from the
step: their sum is the server's per-token overhead against the same engine in-process. Run it on
the server's host (it reads /proc):

    python -m tritium.client.bench.server_cpu_bench --url 127.0.0.1:8001 --model smollm2
    python -m tritium.client.bench.server_cpu_bench --url 127.0.0.1:8001 --concurrency 16 --engine ENGINE_DIR

`--protocol grpc,http` reads the same server both ways, rounds alternated (grpc: tritonclient's
stream; http: Triton's generate_stream SSE, the serving benchmark's HTTP driver, on the HTTP port
of tritonserver's command line). The client column is this process's CPU over the round.

With --engine the server and the in-process engine (AsyncLLMEngine, the server's thread policy)
alternate round by round in one run; the in-process rows count this process's threads by the
same names (tritium-loop: the step; tritium-deliver; the rest of the process: the benchmark's
own workers, as "client").

The stub's threads are told apart by the names the backend gives them (tritium-loop: the engine
step, and the OpenMP workers it starts, which inherit its name; tritium-deliver: responses;
tritium-stats: cancellation and metrics); the stub's main thread runs execute() and the IPC with
tritonserver; its unnamed threads are the stub's own helpers (and OpenMP workers started before
the engine loop, if any). Linux only; CPU times come in clock ticks (10 ms), so use a few hundred
tokens a round.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import threading
import time
from typing import Dict, Optional

from tritium.client import grpc_setup
from tritium.client.bench.bench_drivers import REQUESTED_OUTPUTS, greedy_stream_inputs

ROLES = ("tritium-loop", "loop workers", "stub unnamed", "tritium-deliver", "tritium-stats", "stub main", "tritonserver", "client")
OVERHEAD = ("tritium-deliver", "tritium-stats", "stub main", "tritonserver", "client")  # beside the step


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def find_processes(grpc_port: int, model: str) -> Dict[str, int]:
    """{"server": tritonserver's pid, "stub": the stub of `model`} from /proc."""
    server = stub = None
    stubs = []
    pat = re.compile(rf"/{re.escape(model)}/\d+/model\.py ")
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        cmd = _cmdline(int(p))
        if "triton_python_backend_stub" in cmd and pat.search(cmd + " "):
            stubs.append(int(p))
        elif "tritonserver " in cmd and f"--grpc-port={grpc_port} " in cmd + " ":
            server = int(p)
    if server is None:
        raise OSError(f"--url: no tritonserver with --grpc-port={grpc_port} runs on this host")
    for s in stubs:
        if _ppid(s) == server:
            stub = s
    if stub is None:
        raise ValueError(f"--model {model}: tritonserver {server} runs no Python backend stub for it")
    return {"server": server, "stub": stub}


def thread_cpu(procs: Dict[str, int]) -> Dict[str, float]:
    """CPU seconds so far per role (ROLES), summed over the threads of each."""
    hz = os.sysconf("SC_CLK_TCK")
    out = dict.fromkeys(ROLES, 0.0)
    for kind, pid in dict(procs, client=os.getpid()).items():
        loop_tid = None  # the loop thread: the first thread named tritium-loop (OpenMP's workers follow it)
        for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    st = f.read()
            except OSError:  # the thread ended
                continue
            name = st[st.index("(") + 1:st.rindex(")")]
            fields = st[st.rindex(")") + 2:].split()
            cpu = (int(fields[11]) + int(fields[12])) / hz
            if kind == "stub":
                role = name if name in ROLES else "stub main" if int(tid) == pid else "stub unnamed"
                if role == "tritium-loop":
                    role, loop_tid = ("tritium-loop", tid) if loop_tid is None else ("loop workers", loop_tid)
            else:
                role = "tritonserver" if kind == "server" else "client"
            out[role] += cpu
    return out


class _Stream:
    def __init__(self, url: str, model: str, outputs: Optional[list]):
        import tritonclient.grpc as grpcclient
        self.g, self.model, self.outputs = grpcclient, model, outputs
        self.client = grpcclient.InferenceServerClient(url)
        self.done, self.error, self.responses = threading.Event(), None, 0
        self.client.start_stream(callback=self._on)

    def _on(self, result, error) -> None:
        if error is not None:
            self.error = str(error)
            self.done.set()
            return
        resp = result.get_response()
        if resp.outputs:
            self.responses += 1
            for out in resp.outputs:  # read every output asked for, as a client would
                result.as_numpy(out.name)
        final = resp.parameters.get("triton_final_response")
        if final is not None and final.bool_param:
            self.done.set()

    def run(self, tokens: int) -> int:
        g = self.g
        inputs = greedy_stream_inputs(g, "Passage CPU: the river runs past the old mill and", tokens)
        outs = [g.InferRequestedOutput(n) for n in self.outputs] if self.outputs else None
        self.done.clear()
        self.responses = 0
        self.client.async_stream_infer(self.model, inputs, outputs=outs, enable_empty_final_response=True)
        if not self.done.wait(600):
            raise TimeoutError("no final response within 600 s")
        if self.error:
            raise RuntimeError(f"the server failed the request: {self.error}")
        return self.responses

    def close(self) -> None:
        self.client.stop_stream(cancel_requests=False)
        self.client.close()


def http_url(server_pid: int) -> str:
    """tritonserver's own HTTP HOST:PORT, from its command line."""
    cmd = _cmdline(server_pid) + " "
    port = re.search(r"--http-port=(\d+) ", cmd)
    addr = re.search(r"--http-address=(\S+) ", cmd)
    if port is None:
        raise OSError(f"tritonserver {server_pid} runs no HTTP service (no --http-port)")
    return f"{addr.group(1) if addr else '127.0.0.1'}:{port.group(1)}"


class _HttpStream:
    """One keep-alive generate_stream session (the benchmark's HTTP driver)."""

    def __init__(self, url: str, model: str):
        from tritium.client.bench.bench_triton_http import TritonHttpDriver
        self.drv = TritonHttpDriver(url, model)
        self.drv.check()
        self.session, self.n = self.drv.session(), 0

    def run(self, tokens: int) -> int:
        from tritium.client.bench.bench_workload import BenchRequest
        self.n += 1
        res = self.session.run(BenchRequest(0, "Passage CPU: the river runs past the old mill and", 10, tokens),
                               f"cpu-{self.n}")
        if not res.ok or res.output_tokens != tokens:
            raise RuntimeError(f"the server failed the request: {res.error or res.output_tokens}")
        return len(res.chunk_tokens)

    def close(self) -> None:
        self.session.close()


def measure(url: str, model: str, tokens: int, rounds: int, outputs: Optional[list],
            protocols=("grpc",)) -> dict:
    """Single streams of `tokens` tokens, `rounds` per protocol; with two protocols the rounds
    alternate, the order flipped each round. The client's CPU is this process's (process_time)."""
    procs = find_processes(int(url.rsplit(":", 1)[1]), model)
    streams = {}
    try:
        for proto in protocols:
            streams[proto] = _Stream(url, model, outputs) if proto == "grpc" else \
                _HttpStream(http_url(procs["server"]), model)
            streams[proto].run(8)  # warm-up
        rows = []
        for r in range(rounds):
            for proto in (protocols if r % 2 == 0 else protocols[::-1]):
                before, c0, t0 = thread_cpu(procs), time.process_time(), time.perf_counter()
                responses = streams[proto].run(tokens)
                wall, c1, after = time.perf_counter() - t0, time.process_time(), thread_cpu(procs)
                ms = {k: 1000 * (after[k] - before[k]) / tokens for k in ROLES}
                ms["client"] = 1000 * (c1 - c0) / tokens
                ms["overhead"] = sum(ms[k] for k in OVERHEAD)
                rows.append({"round": r, "protocol": proto, "tok_s": tokens / wall, "responses": responses,
                             "ms_per_token": ms})
    finally:
        for st in streams.values():
            st.close()
    return {"url": url, "model": model, "tokens": tokens, "outputs": outputs or "all", "processes": procs,
            "protocols": list(protocols), "rounds": rows}


def _own_cpu() -> Dict[str, float]:
    """This process's CPU seconds so far: {"tritium-loop": the loop thread (and OpenMP workers it
    started), "tritium-deliver": its delivery thread, "process": every thread}."""
    hz = os.sysconf("SC_CLK_TCK")
    out = {"tritium-loop": 0.0, "loop workers": 0.0, "tritium-deliver": 0.0, "process": 0.0}
    seen_loop = False
    for tid in sorted(os.listdir("/proc/self/task"), key=int):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                st = f.read()
        except OSError:
            continue
        name = st[st.index("(") + 1:st.rindex(")")]
        fields = st[st.rindex(")") + 2:].split()
        cpu = (int(fields[11]) + int(fields[12])) / hz
        out["process"] += cpu
        if name == "tritium-loop":
            name, seen_loop = ("loop workers" if seen_loop else name), True
        if name in out:
            out[name] += cpu
    return out


def _in_process_driver(engine_dir: str):
    """The engine in this process as the server runs it: its thread policy and queue bound."""
    from tritium.backend.engine_options import engine_setup
    from tritium.client.bench.bench_drivers import InProcessDriver
    setup = engine_setup({}, server=True)
    return InProcessDriver(engine_dir, thread_policy=setup.thread_policy, **setup.engine_kwargs)


def measure_workload(url: str, model: str, concurrency: int, rounds: int, engine_dir: Optional[str],
                     protocols=("grpc",)) -> dict:
    """The default serving workload at `concurrency`, through the server (per-role CPU from /proc;
    a row per protocol: server-grpc, server-http) and, with engine_dir, in this process;
    alternating, the order flipped each round."""
    from tritium.client.bench.bench_runner import run_requests
    from tritium.client.bench.bench_triton_http import make_triton_driver
    from tritium.client.bench.bench_workload import WorkloadSpec, make_requests
    procs = find_processes(int(url.rsplit(":", 1)[1]), model)
    drivers = {f"server-{p}": make_triton_driver(p, url if p == "grpc" else http_url(procs["server"]), model)
               for p in protocols}
    for d in drivers.values():
        d.check()
    if engine_dir:
        drivers["in-process"] = _in_process_driver(engine_dir)
    rows = []
    try:
        for name, d in drivers.items():  # warm-up: a short run of 2 requests each
            run_requests(d, make_requests(WorkloadSpec(2, (12, 24), (16, 32)), tag=f"w{name}"), 2, "warm", progress=False)
        for r in range(rounds):
            order = list(drivers) if r % 2 == 0 else list(drivers)[::-1]
            for name in order:
                reqs = make_requests(WorkloadSpec(), tag=f"cpu{r}{name}")
                own0, srv0 = _own_cpu(), thread_cpu(procs)
                res = run_requests(drivers[name], reqs, concurrency, f"c{concurrency}", progress=False)
                own1, srv1 = _own_cpu(), thread_cpu(procs)
                bad = [x for x in res.results if not x.ok]
                if bad:
                    raise RuntimeError(f"{name}: {len(bad)} requests failed, e.g. {bad[0].error}")
                tokens = sum(x.output_tokens for x in res.results)
                # The benchmark's workers and gRPC threads end with the run, and /proc forgets an
                # ended thread's CPU: the client's share is the process's CPU time over the run.
                client = 1000 * res.client_cpu_s / tokens
                if name.startswith("server"):
                    ms = {k: 1000 * (srv1[k] - srv0[k]) / tokens for k in ROLES}
                    ms["client"] = client
                    ms["overhead"] = sum(ms[k] for k in OVERHEAD)
                else:
                    loop, workers, dlv = (1000 * (own1[k] - own0[k]) / tokens
                                          for k in ("tritium-loop", "loop workers", "tritium-deliver"))
                    total = 1000 * (own1["process"] - own0["process"]) / tokens  # threads alive at the end
                    ms = dict.fromkeys(ROLES, 0.0)
                    ms.update({"tritium-loop": loop, "loop workers": workers, "tritium-deliver": dlv, "client": client,
                               "stub unnamed": max(0.0, total - loop - workers - dlv)})
                    ms["overhead"] = dlv + client
                cpu_ms = sum(ms[k] for k in ROLES)
                responses = sum(len(x.chunk_tokens) for x in res.results)  # those that carried tokens
                rows.append({"round": r, "system": name, "tok_s": tokens / res.duration_s, "tokens": tokens,
                             "tokens_per_response": tokens / responses if responses else None,
                             "tok_per_cpu_s": 1000 / cpu_ms if cpu_ms else None, "ms_per_token": ms})
    finally:
        for d in drivers.values():
            d.close()
    return {"url": url, "model": model, "concurrency": concurrency, "engine": engine_dir,
            "processes": procs, "rounds": rows}


def _print_workload(res: dict) -> None:
    print(f"{res['model']} at {res['url']}: default workload at concurrency {res['concurrency']}; "
          f"CPU ms per output token (in-process: unnamed = the process's other threads)")
    print("round  system         tok/s  tok/CPU-s  tok/resp  " + "  ".join(f"{r:>15}" for r in ROLES) + "  overhead")
    for row in res["rounds"]:
        ms = row["ms_per_token"]
        print(f"{row['round']:5d}  {row['system']:<12} {row['tok_s']:6.1f}  {row['tok_per_cpu_s'] or 0:9.1f}  "
              f"{row['tokens_per_response'] or 0:8.2f}  "
              + "  ".join(f"{ms[r]:15.3f}" for r in ROLES) + f"  {ms['overhead']:8.3f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tritium.client.bench.server_cpu_bench", description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="127.0.0.1:8001", help="tritonserver's gRPC HOST:PORT, on this host")
    ap.add_argument("--model", default="smollm2", help="the tritium model (not its ensemble or BLS)")
    ap.add_argument("--tokens", type=int, default=384, help="tokens per single stream (default 384)")
    ap.add_argument("--rounds", type=int, default=3, help="single streams measured (default 3)")
    ap.add_argument("--outputs", default="bench",
                    help="outputs the client requests and reads: bench (those of the serving benchmark: "
                         + ", ".join(REQUESTED_OUTPUTS) + "), all, or a comma list")
    ap.add_argument("--concurrency", type=int, default=0,
                    help="measure the default 32-request workload at this concurrency instead of single streams")
    ap.add_argument("--engine", default=None,
                    help="with --concurrency: also run ENGINE_DIR in this process, alternating with the server")
    ap.add_argument("--protocol", default="grpc", choices=("grpc", "http", "grpc,http", "http,grpc"),
                    help="how the client reads the server: grpc (tritonclient's stream), http (generate_stream "
                         "SSE, the benchmark's HTTP driver; the port is read from tritonserver's command line) or "
                         "both, rounds alternated (default grpc); --outputs applies to grpc only")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    a = ap.parse_args(argv)
    protocols = tuple(a.protocol.split(","))
    grpc_setup.apply()  # before tritonclient imports grpc, as the `tritium` command does
    for flag, v, low in (("--tokens", a.tokens, 16), ("--rounds", a.rounds, 1)):
        if v < low:
            print(f"{flag} must be >= {low}, got {v}", file=sys.stderr)
            return 2
    if ":" not in a.url or not a.url.rsplit(":", 1)[1].isdigit():
        print(f"--url must be HOST:PORT, got {a.url!r}", file=sys.stderr)
        return 2
    if not sys.platform.startswith("linux"):
        print("server_cpu_bench reads /proc: Linux only", file=sys.stderr)
        return 2
    if a.concurrency < 0 or (a.engine and not a.concurrency):
        print("--concurrency must be >= 1 (and --engine needs it)", file=sys.stderr)
        return 2
    if a.engine and not os.path.isfile(os.path.join(a.engine, "engine.json")):
        print(f"--engine {a.engine}: no engine.json there", file=sys.stderr)
        return 2
    if a.concurrency:
        try:
            res = measure_workload(a.url, a.model, a.concurrency, a.rounds, a.engine, protocols)
        except (OSError, ValueError) as e:
            print(str(e), file=sys.stderr)
            return 2
        print(json.dumps(res)) if a.json else _print_workload(res)
        return 0
    outputs = None if a.outputs == "all" else list(REQUESTED_OUTPUTS) if a.outputs == "bench" \
        else [s for s in a.outputs.split(",") if s]
    try:
        res = measure(a.url, a.model, a.tokens, a.rounds, outputs, protocols)
    except (OSError, ValueError) as e:
        print(str(e), file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(res))
        return 0
    print(f"{a.model} at {a.url}: {a.tokens} tokens a stream, outputs {res['outputs']}; CPU ms per token")
    print("round  protocol  tok/s  " + "  ".join(f"{r:>15}" for r in ROLES) + "  overhead")
    for row in res["rounds"]:
        ms = row["ms_per_token"]
        print(f"{row['round']:5d}  {row['protocol']:<8} {row['tok_s']:6.1f}  " + "  ".join(f"{ms[r]:15.3f}" for r in ROLES) + f"  {ms['overhead']:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
