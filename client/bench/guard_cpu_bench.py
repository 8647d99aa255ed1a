"""The HTTP guard's CPU per streamed token (client/serve/http_guard.py): a benchmark that prints figures.

    python -m tritium.client.bench.guard_cpu_bench --relay 3000
    python -m tritium.client.bench.guard_cpu_bench --url 127.0.0.1:8001 --public-http 127.0.0.1:8000 --tokens 1000 --rounds 6

--relay N: the guard's event loop alone, in this process: a fake upstream thread sends N
generate_stream events (one chunk each, 0.4 ms apart), a client thread reads them through a Guard;
printed: the loop thread's CPU per event.

--url / --public-http: single greedy streams of --tokens tokens over HTTP generate_stream (the
serving benchmark's HTTP driver, naming its four outputs) through `tritium serve`'s public HTTP
port (the guard) and on tritonserver's own HTTP port (read from its command line), alternated,
the order flipped each round. Per round: CPU ms per token of the guard process, tritonserver, the
model's stub (every thread; its engine loop apart) and this client, and the voluntary context
switches per token of each (/proc/PID/task/TID/status: each is a sleep and a wake-up, and on a
2-core host each wake-up beside the step preempts one of its threads). Linux only; run it on the
server's host.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
import threading
import time
from typing import Dict

from tritium.client.bench.server_cpu_bench import _cmdline, _ppid, find_processes, http_url

EVENT = (b'data: {"model_name":"smollm2","model_version":"1","num_input_tokens":[9],"num_output_tokens":[17],'
         b'"output_ids":[1234],"text_output":" the"}\n\n')
ROLES = ("loop", "guard", "tritonserver", "stub", "client")


def relay_cpu_per_event(num_events: int) -> float:
    """Thread CPU (us) of a Guard's event loop per relayed event, upstream and client faked."""
    from tritium.client.serve.http_checks import GuardLimits
    from tritium.client.serve.http_guard import Guard
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen()

    def upstream():
        c, _ = ls.accept()
        buf = b""
        while b"\r\n\r\n" not in buf:
            buf += c.recv(65536)
        c.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(num_events):
            c.sendall(b"%x\r\n%s\r\n" % (len(EVENT), EVENT))
            time.sleep(0.0004)
        c.sendall(b"0\r\n\r\n")
        c.recv(1)  # until the guard closes
        c.close()

    got = []

    def client(port):
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"POST /v2/models/m/generate_stream HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 2\r\nConnection: close\r\n\r\n{}")
            data = b""
            while not data.endswith(b"\r\n0\r\n\r\n"):
                d = s.recv(65536)
                if not d:
                    break
                data += d
            got.append(data.count(b"data: "))

    async def main():
        threading.Thread(target=upstream, daemon=True).start()
        srv = await asyncio.start_server(Guard(("127.0.0.1", ls.getsockname()[1]), GuardLimits(), None).handle,
                                         "127.0.0.1", 0)
        t = threading.Thread(target=client, args=(srv.sockets[0].getsockname()[1],))
        t0 = time.thread_time()
        t.start()
        while t.is_alive():
            await asyncio.sleep(0.02)
        cpu = time.thread_time() - t0
        srv.close()
        return cpu
    cpu = asyncio.run(main())
    ls.close()
    if got != [num_events]:
        raise RuntimeError(f"the client read {got} events, {num_events} sent")
    return 1e6 * cpu / num_events


def _guard_pid(server_pid: int) -> int:
    """The HTTP guard started beside tritonserver (same parent)."""
    parent = _ppid(server_pid)
    for p in os.listdir("/proc"):
        if p.isdigit() and "serve.http_guard" in _cmdline(int(p)) and _ppid(int(p)) == parent:
            return int(p)
    raise OSError(f"no HTTP guard runs beside tritonserver {server_pid}")


def _usage(pid: int) -> Dict[str, list]:
    """{thread name: [CPU seconds, voluntary switches]} summed over a process's threads."""
    hz, out = os.sysconf("SC_CLK_TCK"), {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                st = f.read()
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                status = f.read()
        except OSError:
            continue
        fields = st[st.rindex(")") + 2:].split()
        u = out.setdefault(st[st.index("(") + 1:st.rindex(")")], [0.0, 0])
        u[0] += (int(fields[11]) + int(fields[12])) / hz
        u[1] += int(status.split("\nvoluntary_ctxt_switches:")[1].split()[0])
    return out


def _snapshot(procs: Dict[str, int]) -> Dict[str, list]:
    out = {r: [0.0, 0] for r in ROLES}
    for kind, pid in procs.items():
        for name, (cpu, sw) in _usage(pid).items():
            role = "loop" if kind == "stub" and name == "tritium-loop" else kind
            out[role][0] += cpu
            out[role][1] += sw
    return out


def measure(url: str, public_http: str, model: str, tokens: int, rounds: int) -> list:
    from tritium.client.bench.bench_workload import BenchRequest
    from tritium.client.bench.bench_triton_http import TritonHttpDriver
    procs = find_processes(int(url.rsplit(":", 1)[1]), model)
    procs = {"tritonserver": procs["server"], "stub": procs["stub"], "guard": _guard_pid(procs["server"]),
             "client": os.getpid()}
    sessions = {}
    for name, target in (("guard", public_http), ("direct", http_url(procs["tritonserver"]))):
        drv = TritonHttpDriver(target, model)
        drv.check()
        sessions[name] = (drv, drv.session())
    rows = []
    try:
        for r in range(rounds + 1):  # round 0 warms both up, unmeasured
            for name in (("guard", "direct") if r % 2 == 0 else ("direct", "guard")):
                before, t0 = _snapshot(procs), time.perf_counter()
                res = sessions[name][1].run(BenchRequest(0, "Passage CPU: the river runs past the old mill and",
                                                         10, tokens if r else 8), f"guard-cpu-{r}-{name}")
                wall, after = time.perf_counter() - t0, _snapshot(procs)
                if not res.ok:
                    raise RuntimeError(f"the server failed the request: {res.error}")
                if r:
                    n = res.output_tokens
                    rows.append({"round": r, "port": name, "tok_s": n / wall,
                                 "ms_per_token": {k: 1000 * (after[k][0] - before[k][0]) / n for k in ROLES},
                                 "switches_per_token": {k: (after[k][1] - before[k][1]) / n for k in ROLES}})
    finally:
        for _, session in sessions.values():
            session.close()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tritium.client.bench.guard_cpu_bench", description=__doc__.split("\n")[0])
    ap.add_argument("--relay", type=int, default=0, help="the guard's event loop alone: N fake events")
    ap.add_argument("--url", default="127.0.0.1:8001", help="tritonserver's gRPC HOST:PORT, on this host")
    ap.add_argument("--public-http", default="127.0.0.1:8000", help="`tritium serve`'s HTTP HOST:PORT (the guard)")
    ap.add_argument("--model", default="smollm2", help="the tritium model")
    ap.add_argument("--tokens", type=int, default=1000, help="tokens per stream (default 1000)")
    ap.add_argument("--rounds", type=int, default=4, help="streams per port (default 4)")
    a = ap.parse_args(argv)
    for flag, v, low in (("--relay", a.relay, 0), ("--tokens", a.tokens, 16), ("--rounds", a.rounds, 1)):
        if v < low:
            print(f"{flag} must be >= {low}, got {v}", file=sys.stderr)
            return 2
    if a.relay:
        print(f"guard event loop, {a.relay} events: {relay_cpu_per_event(a.relay):.1f} us CPU per event")
        return 0
    if not sys.platform.startswith("linux"):
        print("guard_cpu_bench reads /proc: Linux only", file=sys.stderr)
        return 2
    try:
        rows = measure(a.url, a.public_http, a.model, a.tokens, a.rounds)
    except (OSError, ValueError) as e:
        print(str(e), file=sys.stderr)
        return 2
    print(f"{a.model}: {a.tokens} tokens a stream; CPU ms per token (voluntary switches per token)")
    print("round  port    tok/s  " + "  ".join(f"{r:>18}" for r in ROLES) + "  beside the step")
    for row in rows:
        ms, sw = row["ms_per_token"], row["switches_per_token"]
        beside = sum(ms[k] for k in ROLES if k != "loop")
        print(f"{row['round']:5d}  {row['port']:<6} {row['tok_s']:6.1f}  "
              + "  ".join(f"{ms[k]:11.3f} ({sw[k]:4.1f})" for k in ROLES) + f"  {beside:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
