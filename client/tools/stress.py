"""Hostile-client stress test of a Tritium server: fuzz, cancels, a burst and a soak.

    python -m tritium.client.tools.stress --repo REPO --model NAME            # starts tritonserver itself
    python -m tritium.client.tools.stress --grpc-url H:P --http-url H:P --metrics-url URL --model NAME

Phases (each can be sized or skipped with 0):
  fuzz    --fuzz N random requests (well-formed, odd and hostile; half gRPC, half HTTP through the
          guard) with --concurrency workers; every answer must be a response or an error, never
          silence (a "hang") or a dead server;
  cancel  --cancels N streams cancelled after 1-3 responses; afterwards the KV blocks in use
          must return to 0 (no leak);
  burst   --burst-factor x the model's max batch size of concurrent requests, all at once;
  soak    --soak-seconds of mixed load, the server's RSS sampled every --rss-every seconds.
Prints one JSON object with the counts, timings and RSS figures; exit 1 if anything crashed,
hung or leaked.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional

from tritium.client.tools.stress_requests import (group_rss_bytes, kv_blocks_used, random_request, send_grpc,
                                                  send_http, server_alive)


class Target:
    """Where requests go, and (when we started it) the server process to watch."""

    def __init__(self, grpc_url: str, http_url: str, metrics_url: str, model: str, srv=None):
        self.grpc_url, self.http_url, self.metrics_url, self.model, self.srv = \
            grpc_url, http_url, metrics_url, model, srv

    def rss(self) -> Optional[int]:
        if self.srv is None:
            return None
        groups = {self.srv.proc.pid} | ({self.srv.guard_proc.pid} if self.srv.guard_proc else set())
        return group_rss_bytes(groups)


def fuzz(t: Target, num: int, concurrency: int, seed: int, timeout: float) -> Dict[str, int]:
    """Send `num` random requests; returns counts per outcome (ok / error / hang / down)."""
    counts: Dict[str, int] = {}
    lock = threading.Lock()

    def one(i: int):
        rng = random.Random(seed * 1_000_003 + i)
        grpc = i % 2 == 0
        fields = random_request(rng, grpc)
        try:
            outcome, _ = (send_grpc(t.grpc_url, t.model, fields, timeout) if grpc
                          else send_http(t.http_url, t.model, fields, timeout))
        except Exception as e:  # the client library itself failing counts, by name
            outcome = f"client:{type(e).__name__}"
        with lock:
            counts[outcome] = counts.get(outcome, 0) + 1
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(num)))
    return counts


def cancels(t: Target, num: int, concurrency: int, seed: int) -> Dict[str, object]:
    """Open `num` long streams and cancel each after 1-3 responses; then wait for the KV blocks to drain."""
    from tritium.client.triton_client import TritiumClient
    errors: List[str] = []

    def one(i: int):
        rng = random.Random(seed + i)
        protocol = "grpc" if i % 3 else "http"
        c = TritiumClient(t.grpc_url if protocol == "grpc" else t.http_url, protocol=protocol, model=t.model)
        stream = c.stream(rng.choice(["Hello", "Tell me a story", "1 2 3"]), max_tokens=200, min_tokens=200,
                          temperature=0.8)
        try:
            for _ in range(rng.randint(1, 3)):
                next(stream)
        except StopIteration:
            pass
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}")
        finally:
            stream.close()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(num)))
    deadline, used = time.monotonic() + 60, None
    while time.monotonic() < deadline:
        used = kv_blocks_used(t.metrics_url)
        if used == 0:
            break
        time.sleep(0.2)
    return {"cancelled": num, "client_errors": len(errors), "kv_blocks_used_after": used,
            "first_errors": errors[:3]}


def burst(t: Target, num: int, timeout: float) -> Dict[str, object]:
    """`num` requests released together; returns outcomes, wall time and RSS before / after."""
    rss0 = t.rss()
    barrier = threading.Barrier(num)
    counts: Dict[str, int] = {}
    lock = threading.Lock()

    def one(i: int):
        barrier.wait()
        fields = {"text_input": f"Request {i}: write a line about the sea.", "max_tokens": 16, "temperature": 0.0}
        outcome, _ = send_grpc(t.grpc_url, t.model, fields, timeout)
        with lock:
            counts[outcome] = counts.get(outcome, 0) + 1
    t0 = time.monotonic()
    with ThreadPoolExecutor(num) as pool:
        list(pool.map(one, range(num)))
    return {"requests": num, "outcomes": counts, "seconds": round(time.monotonic() - t0, 1),
            "rss_before_mb": _mb(rss0), "rss_after_mb": _mb(t.rss())}


def soak(t: Target, seconds: float, concurrency: int, rss_every: float, seed: int, timeout: float) -> dict:
    """Mixed fuzz traffic for `seconds`; RSS samples (MB) every `rss_every` seconds."""
    stop = time.monotonic() + seconds
    samples, counts, batch = [], {}, 0
    next_sample = time.monotonic()
    while time.monotonic() < stop:
        if time.monotonic() >= next_sample:
            samples.append(_mb(t.rss()))
            next_sample += rss_every
        for k, v in fuzz(t, concurrency * 4, concurrency, seed + batch, timeout).items():
            counts[k] = counts.get(k, 0) + v
        batch += 1
    samples.append(_mb(t.rss()))
    rss = [s for s in samples if s is not None]
    return {"seconds": seconds, "requests": sum(counts.values()), "outcomes": counts, "rss_mb": rss,
            "rss_first_mb": rss[0] if rss else None, "rss_last_mb": rss[-1] if rss else None,
            "rss_max_mb": max(rss) if rss else None}


def _mb(b: Optional[int]) -> Optional[float]:
    return None if b is None else round(b / 2 ** 20, 1)


def run(t: Target, args) -> dict:
    report: dict = {"model": t.model, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    t0 = time.monotonic()
    if args.fuzz:
        report["fuzz"] = fuzz(t, args.fuzz, args.concurrency, args.seed, args.timeout)
        report["fuzz_seconds"] = round(time.monotonic() - t0, 1)
        report["alive_after_fuzz"] = server_alive(t.srv)
    if args.cancels:
        report["cancel"] = cancels(t, args.cancels, args.concurrency, args.seed)
    if args.burst_factor:
        report["burst"] = burst(t, args.burst_factor * args.max_batch, args.timeout)
    if args.soak_seconds:
        report["soak"] = soak(t, args.soak_seconds, args.concurrency, args.rss_every, args.seed, args.timeout)
    report["alive_at_end"] = server_alive(t.srv)
    report["seconds"] = round(time.monotonic() - t0, 1)
    return report


def failures(report: dict) -> List[str]:
    """What went wrong: hangs, dead server, leaked KV blocks, failed burst requests."""
    out = []
    for phase in ("fuzz",):
        for k, v in report.get(phase, {}).items():
            if k not in ("ok", "error"):
                out.append(f"{phase}: {v} x {k}")
    for phase in ("burst", "soak"):
        for k, v in report.get(phase, {}).get("outcomes", {}).items():
            if k not in ("ok",) + (("error",) if phase == "soak" else ()):
                out.append(f"{phase}: {v} x {k}")
    if report.get("cancel", {}).get("kv_blocks_used_after") not in (None, 0, 0.0):
        out.append(f"cancel: {report['cancel']['kv_blocks_used_after']} KV blocks still used")
    if report.get("alive_at_end") is False or report.get("alive_after_fuzz") is False:
        out.append("the server died")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tritium.client.tools.stress", description=__doc__.splitlines()[0])
    p.add_argument("--repo", help="start tritonserver on this repository (else give the URLs)")
    p.add_argument("--grpc-url"), p.add_argument("--http-url"), p.add_argument("--metrics-url")
    p.add_argument("--model", required=True, help="the tritium LLM model's name")
    p.add_argument("--fuzz", type=int, default=10_000)
    p.add_argument("--cancels", type=int, default=1_000)
    p.add_argument("--burst-factor", type=int, default=10, help="burst = this x --max-batch concurrent requests")
    p.add_argument("--max-batch", type=int, default=64, help="the model's max batch size (default 64)")
    p.add_argument("--soak-seconds", type=float, default=1800.0)
    p.add_argument("--rss-every", type=float, default=30.0)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds of silence that count as a hang")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="also write the JSON report here")
    args = p.parse_args(argv)
    srv = None
    if args.repo:
        from tritium.client.serve.server import TritonServer, cache_dir
        srv = TritonServer(args.repo, log_file=os.path.join(cache_dir(), "stress-server.log")).start()
        t = Target(srv.grpc_url, srv.http_url, srv.metrics_url, args.model, srv)
    elif args.grpc_url and args.http_url and args.metrics_url:
        t = Target(args.grpc_url, args.http_url, args.metrics_url, args.model)
    else:
        p.error("give --repo, or all of --grpc-url, --http-url and --metrics-url")
    try:
        report = run(t, args)
    finally:
        if srv is not None:
            srv.stop()
    report["failures"] = failures(report)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
