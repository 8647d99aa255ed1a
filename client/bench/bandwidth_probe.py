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
"""
from __future__ import annotations

import statistics
import time
from typing import Dict, List, Optional

PROBE_PASSES = 3  # each pass reads the whole buffer once; the probe reports the best pass
PROBE_MB = 128    # at most: 4x this host's 32 MiB L3, 3 passes 12 ms at 33 GB/s


class ReadProbe:
    """A short read of a float32 buffer of `mb` MB on `pages` ("2MiB" or "4KiB") pages with torch on
    `threads` threads: call it for the best GB/s (1e9 bytes/s) of `passes` passes. Every reading is
    kept in `readings` as (start time, GB/s, seconds spent) (time.perf_counter)."""

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
        self.readings: List[tuple] = []
        self()  # touch the pages and start the threads
        self.readings.clear()

    def __call__(self) -> float:
        import torch
        saved = torch.get_num_threads()
        if saved != self.threads:
            torch.set_num_threads(self.threads)
        t_start = time.perf_counter()
        best = float("inf")
        try:
            for _ in range(self.passes):
                t0 = time.perf_counter()
                self.buf.sum()
                best = min(best, time.perf_counter() - t0)
        finally:
            if saved != self.threads:
                torch.set_num_threads(saved)
        gbs = self.nbytes / best / 1e9
        self.readings.append((t_start, gbs, time.perf_counter() - t_start))
        return gbs

    def describe(self) -> dict:
        return {"threads": self.threads, "buffer_mb": self.mb, "pages": self.pages, "passes": self.passes}


def probe_for_host(host: dict, passes: int = PROBE_PASSES) -> Optional[ReadProbe]:
    """The probe matching the host report's start-of-run read (its threads and the page placement
    that read faster there; its buffer, at most PROBE_MB); None when the report has no memory
    measurement."""
    mem = host.get("memory")
    if not mem:
        return None
    return ReadProbe(mem["threads"], min(mem["buffer_mb"], PROBE_MB), mem.get("read_pages", "2MiB"), passes)


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
    "probed_requests": each {"tok_s", "probe_gbs": [before, after]}): the median of the
    requests' shares, each request's share, and the probes' min / max."""
    rows = [p for p in probed if p.get("tok_s") and p.get("probe_gbs") and None not in p["probe_gbs"]]
    if not rows or not weight_bytes:
        return None
    shares = [request_share(p["tok_s"], weight_bytes, *p["probe_gbs"]) for p in rows]
    probes = [g for p in rows for g in p["probe_gbs"]]
    return {"share": statistics.median(shares), "request_shares": shares,
            "tok_s_median": statistics.median(p["tok_s"] for p in rows),
            "probe_gbs_min": min(probes), "probe_gbs_max": max(probes), "requests": len(rows),
            "weight_bytes": weight_bytes}


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
                 f"{same['tok_s_median']:.1f} tok/s)")
    else:
        line += "no same-second figure (no probed single-stream request)"
    if s.get("start_of_run") is not None:
        line += (f"; start-of-run figure {s['start_of_run'] * 100:.0f} % (read "
                 f"{s['start_of_run_read_gbs']:.1f} GB/s at the start)")
    return line

