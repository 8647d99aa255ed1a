"""The host's read bandwidth in the same seconds as each single-stream request, and the
single-stream bandwidth share it gives (docs/benchmarks.md, "The bandwidth share").

Why: the host's own 2-thread read rate moves about 2x every 10-30 s (its neighbours come and go),
so a share measured against a read taken once at the start of a run says which state that first
second caught, not how close a stream came to the memory it had. So the benchmark reads memory
for a few tens of milliseconds just before and just after each single-stream request of each
system (every server is idle then) with the start-of-run measurement's thread count and page
placement (whichever of 4 KiB / 2 MiB read faster there), on a buffer of at most 128 MB (still 4x
this host's L3; best of 3 passes, about 10-25 ms on a quiet host), and divides each request's
rate by the mean of its own two probes:

  request share = request tok/s x engine weight bytes / mean(probe before, probe after)
  request tok/s = output tokens / (final response - send)
  engine share  = median of its requests' shares

Decode reads every weight once per token, so tok/s x weight bytes is the stream's read rate. The
request's whole span is used, not first-to-last token: on a busy host a client reads a stream's
events in bursts (many arrive within a millisecond), which leaves the span between the first and
last event meaningless, while the send and the final response bound the work exactly; the short
prompt's prefill (one step of ~16 rows) inside it makes the figure slightly conservative. The
start-of-run figure (single-stream output tok/s x weight bytes / the read at the start) is kept
beside it, labelled, for comparison with older tables.

What runs during a probe is recorded, and the probe waits for the servers first (ReadProbe.set_watch,
cpu_watch.py): each probe waits, bounded, until the servers' process groups and this process are
quiet, then reads, and keeps the cores each of them used during the read, the cores its own
threads ran and waited for a CPU (neighbours on a shared host), and the host's busy / stolen
cores; share_report summarizes them beside the share.
"""
from __future__ import annotations

import os
import queue
import statistics
import threading
import time
from typing import Dict, List, Optional

PROBE_PASSES = 3  # each pass reads the whole buffer once; the probe reports the best pass
PROBE_MB = 128    # at most: 4x this host's 32 MiB L3, 3 passes 12 ms at 33 GB/s
DEFAULT_QUIET_CORES = 0.1  # the watched groups' cores (together) below which the host counts as idle
DEFAULT_MAX_WAIT_S = 1.0   # the longest a probe waits for them to get there


class ReadProbe:
    """A short read of a float32 buffer of `mb` MB on `pages` ("2MiB" or "4KiB") pages with torch on
    `threads` threads: call it for the best GB/s (1e9 bytes/s) of `passes` passes.

    The passes run on the probe's own long-lived thread (its OpenMP team stays warm between calls,
    and its threads are known, so the CPU they spend is not mistaken for someone else's). With a
    `watch` (set_watch: a cpu_watch.CpuWatch over the servers' process groups and this process)
    every call records the cores each watched group kept busy during the read, and with
    `max_wait_s` > 0 it first waits (cpu_watch.wait_quiet, at most max_wait_s) until the watched
    groups together use at most `quiet_cores` cores. Every reading is kept in `readings` as a dict:
    t (start, time.perf_counter), gbs, s (seconds of the read), and with a watch wait_s, quiet,
    polls, cores_before (what ran over the wait's last poll), cores (during the read), busiest
    (the threads with the most CPU during the read: group, name, tid, ms), host (the whole host's
    busy and stolen cores during the read, /proc/stat: neighbours and the probe included) and
    probe_queued (the probe's threads' time ready but waiting for a CPU, in cores: neighbours had
    the cores; its threads' time on a CPU is cores["probe"]).
    The calling thread is left out of the client group (it only waits for the probe's thread)."""

    def __init__(self, threads: int, mb: int, pages: str = "2MiB", passes: int = PROBE_PASSES):
        import torch
        if threads < 1 or mb < 1 or passes < 1:
            raise ValueError(f"read probe: threads, MB and passes must be >= 1, got {threads}, {mb}, {passes}")
        if pages not in ("2MiB", "4KiB"):
            raise ValueError(f"read probe: pages must be 2MiB or 4KiB, got {pages!r}")
        self.threads, self.mb, self.passes = threads, mb, passes
        n = mb * (1 << 20) // 4
        buf = torch.ones(n, dtype=torch.float32)
        self.pages = "4KiB"
        if pages == "2MiB":
            from tritium.client.bench.host_info import _huge_copy
            huge = _huge_copy(buf)
            if huge is not None:
                buf, self.pages = huge, "2MiB"
        self.buf = buf
        self.nbytes = n * 4
        self.readings: List[dict] = []
        self.watch = None
        self.quiet_cores, self.max_wait_s = DEFAULT_QUIET_CORES, 0.0
        before = _own_tids()
        self._jobs: "queue.Queue" = queue.Queue()
        self._done: "queue.Queue" = queue.Queue()
        self._thread = threading.Thread(target=self._serve, name="read-probe", daemon=True)
        self._thread.start()
        self._best_seconds()  # touch the pages and start the threads
        self.own_tids = _own_tids() - before  # the probe thread and its OpenMP team

    def set_watch(self, watch, quiet_cores: float = DEFAULT_QUIET_CORES, max_wait_s: float = DEFAULT_MAX_WAIT_S
                  ) -> None:
        """Watch `watch` (a CpuWatch, or None: stop watching); wait up to max_wait_s (0: no wait) for
        it to go quiet (<= quiet_cores cores) before each read."""
        if quiet_cores < 0 or max_wait_s < 0:
            raise ValueError(f"read probe: quiet cores and max wait must be >= 0, got {quiet_cores}, {max_wait_s}")
        if watch is not None:
            watch.exclude |= self.own_tids
        self.watch, self.quiet_cores, self.max_wait_s = watch, quiet_cores, max_wait_s

    def _serve(self) -> None:
        import torch
        while True:
            self._jobs.get()
            try:
                saved = torch.get_num_threads()
                if saved != self.threads:
                    torch.set_num_threads(self.threads)
                best = float("inf")
                try:
                    for _ in range(self.passes):
                        t0 = time.perf_counter()
                        self.buf.sum()
                        best = min(best, time.perf_counter() - t0)
                finally:
                    if saved != self.threads:
                        torch.set_num_threads(saved)
                self._done.put(best)
            except BaseException as e:  # handed to the caller
                self._done.put(e)

    def _best_seconds(self) -> float:
        self._jobs.put(None)
        got = self._done.get()
        if isinstance(got, BaseException):
            raise got
        return got

    def __call__(self) -> float:
        from tritium.client.bench.cpu_watch import (busiest, busy_cores, host_cores, host_ticks, queued_cores,
                                                    wait_quiet)
        rec: dict = {}
        me = (threading.get_native_id(),)  # the caller: between the samples it only samples and waits
        if self.watch is not None:
            if self.max_wait_s > 0:
                w = wait_quiet(self.watch, self.quiet_cores, self.max_wait_s, skip=me)
                rec.update(wait_s=w["wait_s"], quiet=w["quiet"], polls=w["polls"], cores_before=w["cores"])
            s0, h0 = self.watch.sample(me), host_ticks()
        t_start = time.perf_counter()
        best = self._best_seconds()
        t_end = time.perf_counter()
        gbs = self.nbytes / best / 1e9
        if self.watch is not None:
            h1, s1 = host_ticks(), self.watch.sample(me)
            rec.update(cores=busy_cores(s0, s1, t_end - t_start), busiest=busiest(s0, s1),
                       host=host_cores(h0, h1, t_end - t_start),
                       probe_queued=queued_cores(s0, s1, t_end - t_start).get("probe", 0.0))
        self.readings.append({"t": t_start, "gbs": gbs, "s": t_end - t_start, **rec})
        return gbs

    def last_record(self) -> dict:
        """The last reading, rounded, with its watch figures: what the benchmark keeps per probe
        (RequestResult.probe_watch, the JSON's probed_requests[].probe_watch)."""
        r = self.readings[-1]
        out = {"gbs": round(r["gbs"], 2), "read_ms": round(r["s"] * 1e3, 1)}
        if "wait_s" in r:
            out.update(wait_ms=round(r["wait_s"] * 1e3, 1), quiet=r["quiet"],
                       cores_before={g: round(c, 3) for g, c in r["cores_before"].items()})
        if "cores" in r:
            out["cores"] = {g: round(c, 3) for g, c in r["cores"].items()}
            out["busiest"] = [[g, name, tid, round(ms, 2)] for g, name, tid, ms in r["busiest"]]
            out["host"] = {k: round(v, 2) for k, v in r["host"].items()}
            out["probe_queued"] = round(r["probe_queued"], 3)
        return out

    def describe(self) -> dict:
        d = {"threads": self.threads, "buffer_mb": self.mb, "pages": self.pages, "passes": self.passes}
        if self.watch is not None:
            d.update(watched=self.watch.groups(), quiet_cores=self.quiet_cores, max_wait_s=self.max_wait_s)
        return d


def _own_tids() -> set:
    return {int(t) for t in os.listdir("/proc/self/task")}


def probe_for_host(host: dict, passes: int = PROBE_PASSES) -> Optional[ReadProbe]:
    """The probe matching the host report's start-of-run read (its threads and the page placement
    that read faster there; its buffer, at most PROBE_MB); None when the report has no memory
    measurement."""
    mem = host.get("memory")
    if not mem:
        return None
    return ReadProbe(mem["threads"], min(mem["buffer_mb"], PROBE_MB), mem.get("read_pages", "2MiB"), passes)


def add_probe_flags(p) -> None:
    """--probe-quiet-cores / --probe-max-wait-ms of tritium bench and tritium compare."""
    p.add_argument("--probe-quiet-cores", type=float, default=DEFAULT_QUIET_CORES, metavar="C",
                   help=f"a bandwidth probe waits until the watched processes use at most C cores together "
                        f"(default {DEFAULT_QUIET_CORES})")
    p.add_argument("--probe-max-wait-ms", type=float, default=DEFAULT_MAX_WAIT_S * 1e3, metavar="MS",
                   help=f"... for at most MS ms (default {DEFAULT_MAX_WAIT_S * 1e3:.0f}; 0: no wait, the CPU "
                        "during each probe still recorded)")


def check_probe_flags(args) -> None:
    if not args.probe_quiet_cores >= 0:
        raise ValueError(f"--probe-quiet-cores must be >= 0, got {args.probe_quiet_cores}")
    if not args.probe_max_wait_ms >= 0:
        raise ValueError(f"--probe-max-wait-ms must be >= 0 (0: no wait), got {args.probe_max_wait_ms}")


def watch_probe(probe: Optional[ReadProbe], args, pgids: Dict[str, int]) -> None:
    """Point `probe` (if any) at the process groups `pgids` and this process, with the flags' wait."""
    check_probe_flags(args)
    if probe is not None:
        from tritium.client.bench.cpu_watch import CpuWatch
        probe.set_watch(CpuWatch(pgids), args.probe_quiet_cores, args.probe_max_wait_ms / 1e3)


def request_tok_s(output_tokens: int, t_send: float, t_end: Optional[float]) -> Optional[float]:
    """Output tokens / (final response - send)."""
    if t_end is None or not output_tokens or t_end <= t_send:
        return None
    return output_tokens / (t_end - t_send)


def request_share(tok_s: float, weight_bytes: int, probe_before: float, probe_after: float) -> float:
    """tok/s x weight bytes / the mean of the two probes (GB/s)."""
    return tok_s * weight_bytes / ((probe_before + probe_after) / 2 * 1e9)


def share_report(probed: List[dict], weight_bytes: Optional[int]) -> Optional[dict]:
    """The engine's same-second share from a single-stream run's probed requests (summarize()'s
    "probed_requests": each {"tok_s", "probe_gbs": [before, after]}, with a watching probe also
    "probe_watch": [before, after] of ReadProbe.last_record()): the median of the requests' shares,
    each request's share, the probes' min / max, the median of probe before / probe after, and
    with a watch the probes' waits (median, and how many gave up before the host went quiet), the
    most cores the servers and the client used during a probe, and the median cores the probe's
    own threads ran and waited for a CPU (waiting: neighbours had the cores, and the read measured
    the CPU it got as much as the memory)."""
    rows = [p for p in probed if p.get("tok_s") and p.get("probe_gbs") and None not in p["probe_gbs"]]
    if not rows or not weight_bytes:
        return None
    shares = [request_share(p["tok_s"], weight_bytes, *p["probe_gbs"]) for p in rows]
    probes = [g for p in rows for g in p["probe_gbs"]]
    out = {"share": statistics.median(shares), "request_shares": shares,
           "tok_s_median": statistics.median(p["tok_s"] for p in rows),
           "probe_gbs_min": min(probes), "probe_gbs_max": max(probes), "requests": len(rows),
           "weight_bytes": weight_bytes,
           "before_after_median": statistics.median(p["probe_gbs"][0] / p["probe_gbs"][1] for p in rows)}
    watched = [w for p in rows for w in (p.get("probe_watch") or [])]
    if watched:
        waits = [w["wait_ms"] for w in watched if "wait_ms" in w]
        out.update(wait_ms_median=statistics.median(waits) if waits else None,
                   not_quiet=sum(1 for w in watched if w.get("quiet") is False), probes_watched=len(watched),
                   server_cores_max=max(sum(c for g, c in w["cores"].items() if g not in ("client", "probe"))
                                        for w in watched),
                   client_cores_max=max(w["cores"].get("client", 0.0) for w in watched),
                   probe_cores_median=statistics.median(w["cores"].get("probe", 0.0) for w in watched),
                   probe_queued_median=statistics.median(w.get("probe_queued", 0.0) for w in watched))
    return out


def start_of_run_share(output_tok_s: Optional[float], weight_bytes: Optional[int],
                       read_gbs: Optional[float]) -> Optional[float]:
    """The older figure: single-stream output tok/s x weight bytes / the read measured once at the start."""
    if not output_tok_s or not weight_bytes or not read_gbs:
        return None
    return output_tok_s * weight_bytes / (read_gbs * 1e9)


def shares_of_run(run_summaries: Dict[str, List[dict]], weight_bytes: Dict[str, int],
                  read_gbs: Optional[float]) -> Dict[str, dict]:
    """{system: {"same_second": share_report(...), "start_of_run": share}} for every system with
    known weight bytes and a single-stream run."""
    out = {}
    for system, runs in run_summaries.items():
        nbytes = weight_bytes.get(system)
        single = next((s for s in runs if s["label"] == "single"), None)
        if not nbytes or single is None:
            continue
        out[system] = {"same_second": share_report(single.get("probed_requests") or [], nbytes),
                       "start_of_run": start_of_run_share(single.get("output_tok_s"), nbytes, read_gbs),
                       "start_of_run_read_gbs": read_gbs, "weight_bytes": nbytes}
    return out


def format_share(system: str, s: dict) -> str:
    """'<system>: 71 % of the same-second read (median of 3 requests, each ...; probes 33.1-61.9 GB/s;
    212.0 tok/s); start-of-run figure 39 % (read 64.2 GB/s at the start)'."""
    same = s.get("same_second")
    line = f"{system}: "
    if same:
        line += (f"{same['share'] * 100:.0f} % of the same-second read (median of {same['requests']} requests, "
                 f"each {', '.join(f'{x * 100:.0f}' for x in same['request_shares'])} %; probes "
                 f"{same['probe_gbs_min']:.1f}-{same['probe_gbs_max']:.1f} GB/s; median "
                 f"{same['tok_s_median']:.1f} tok/s; probe before / after median "
                 f"{same['before_after_median']:.2f})")
        if same.get("probes_watched"):
            wait = (f"waited median {same['wait_ms_median']:.0f} ms for quiet, {same['not_quiet']} of "
                    f"{same['probes_watched']} gave up; " if same.get("wait_ms_median") is not None else "no wait; ")
            line += (f" [probes: {wait}during them servers <= {same['server_cores_max']:.2f} cores, "
                     f"client <= {same['client_cores_max']:.2f}; the probe's threads median "
                     f"{same['probe_cores_median']:.2f} cores on a CPU, {same['probe_queued_median']:.2f} "
                     f"waiting for one]")
    else:
        line += "no same-second figure (no probed single-stream request)"
    if s.get("start_of_run") is not None:
        line += (f"; start-of-run figure {s['start_of_run'] * 100:.0f} % (read "
                 f"{s['start_of_run_read_gbs']:.1f} GB/s at the start)")
    return line

