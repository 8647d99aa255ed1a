"""Run a list of requests against a driver: N worker threads (the concurrency), optional seeded
Poisson arrivals, a tqdm progress bar on stderr, and the client's own CPU time.

Each worker opens its session (connection) before the clock starts and then takes the next
request from a shared counter; with --request-rate a request is not sent before its arrival
time, and at most `concurrency` requests are in flight. Client CPU: for a remote system the whole
process's CPU time over the run (every byte of it is client work); in-process, only the worker
threads' own CPU time (the engine's loop thread is the system under test).

Bandwidth probe (single streams, bandwidth_probe.py): with `probe` at concurrency 1 the worker
reads memory just before each request is sent and just after its last response
(RequestResult.probe_gbs; with a watching probe, each probe's wait and the watched processes'
cores in RequestResult.probe_watch); the probes' time (their waits included) is taken out of the
run's duration, so the run's tok/s is what it would be without them.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence

from tritium.client.bench.bench_drivers import RequestResult
from tritium.client.bench.bench_workload import BenchRequest, poisson_arrivals


@dataclass
class RunResult:
    """One run: the raw per-request results and the conditions they were measured under."""
    label: str                      # e.g. "c16" or "single"
    concurrency: int                # max requests in flight
    request_rate: Optional[float]   # Poisson arrivals per second, None = all at once
    results: List[RequestResult]    # in request order
    duration_s: float               # first send -> last response, less the probes' time within it
    client_cpu_s: float             # see the module docstring
    probe_s: float = 0.0            # seconds of bandwidth probes taken out of duration_s


def run_requests(driver, requests: Sequence[BenchRequest], concurrency: int, label: str,
                 request_rate: Optional[float] = None, seed: int = 0, progress: bool = True,
                 desc: Optional[str] = None, client_nice: int = 0, probe=None) -> RunResult:
    """Send every request through `driver`; returns the RunResult (errors are counted, not raised).

    client_nice > 0: each worker thread lowers its own priority to that nice value before it opens
    its session, so the threads a session starts (tritonclient's stream reader, grpc's) inherit
    it (Linux: nice is per thread); the process's other threads keep theirs.

    probe: a callable returning the host's read GB/s (bandwidth_probe.ReadProbe), called before
    and after every request; only at concurrency 1 (a probe beside a request in flight would
    measure the two fighting for memory)."""
    if concurrency < 1:
        raise ValueError(f"--concurrency must be >= 1, got {concurrency}")
    if probe is not None and concurrency != 1:
        raise ValueError(f"a bandwidth probe runs between requests: concurrency must be 1, got {concurrency}")
    arrivals = poisson_arrivals(len(requests), request_rate, seed)
    num_workers = min(concurrency, len(requests))
    results: List[Optional[RequestResult]] = [None] * len(requests)
    lock = threading.Lock()
    next_index = [0]
    start = threading.Barrier(num_workers + 1)
    t0 = [0.0]
    thread_cpu = [0.0] * num_workers
    failures: List[BaseException] = []
    crashes: List[BaseException] = []
    probe_spans: List[tuple] = []  # (start, end) of every probe
    probe_cpu = [0.0, 0.0]         # the probes' process CPU time, and the worker thread's part of it
    bar = _progress_bar(len(requests), desc or label, progress)

    def worker(w: int) -> None:
        try:
            if client_nice:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), client_nice)
            session = driver.session()
        except BaseException as e:  # e.g. the server is gone: fail the run with its reason
            failures.append(e)
            start.abort()
            return
        try:
            start.wait()
            cpu0 = time.thread_time()
            while True:
                with lock:
                    i = next_index[0]
                    next_index[0] += 1
                if i >= len(requests):
                    break
                delay = t0[0] + arrivals[i] - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                before = _probe(probe, probe_spans, probe_cpu) if probe is not None else None
                watch_before = _watch_record(probe)
                res = session.run(requests[i], f"bench-{label}-{i}-{id(results):x}")
                if probe is not None:
                    res.probe_gbs = [before, _probe(probe, probe_spans, probe_cpu)]
                    if watch_before is not None:
                        res.probe_watch = [watch_before, _watch_record(probe)]
                results[i] = res
                with lock:
                    bar.update(1)
            thread_cpu[w] = time.thread_time() - cpu0
        except threading.BrokenBarrierError:
            pass
        except BaseException as e:  # a bug in a driver: report it, do not hang the run
            crashes.append(e)
        finally:
            session.close()

    threads = [threading.Thread(target=worker, args=(w,), name=f"bench-worker-{w}", daemon=True)
               for w in range(num_workers)]
    for t in threads:
        t.start()
    try:
        cpu0 = time.process_time()
        t0[0] = time.perf_counter()
        start.wait()
    except threading.BrokenBarrierError:
        pass
    for t in threads:
        t.join()
    bar.close()
    if failures:
        raise OSError(f"could not open a session with {driver.describe()}: {failures[0]}")
    if crashes:
        raise RuntimeError(f"benchmark worker failed: {crashes[0]!r}") from crashes[0]
    # the probes' CPU is not the client's: take it out
    cpu = sum(thread_cpu) - probe_cpu[1] if driver.in_process else time.process_time() - cpu0 - probe_cpu[0]
    done = [r for r in results if r is not None]
    end = max((r.t_end for r in done if r.t_end is not None), default=t0[0])
    in_run = sum(b - a for a, b in probe_spans if b <= end)
    return RunResult(label, concurrency, request_rate, done, end - t0[0] - in_run, cpu, in_run)


def _probe(probe, spans: list, cpu: list) -> float:
    """probe()'s GB/s; its wall-clock span and CPU time recorded."""
    p0, c0, t0 = time.perf_counter(), time.process_time(), time.thread_time()
    gbs = probe()
    spans.append((p0, time.perf_counter()))
    cpu[0] += time.process_time() - c0
    cpu[1] += time.thread_time() - t0
    return gbs


def _watch_record(probe) -> Optional[dict]:
    """The probe's last reading's wait and watched CPU (ReadProbe with a watch), else None."""
    if probe is None or getattr(probe, "watch", None) is None:
        return None
    return probe.last_record()


def _progress_bar(total: int, desc: str, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="req", leave=False, dynamic_ncols=True)


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass
