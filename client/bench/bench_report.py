"""Figures of a benchmark run: throughput, TTFT, inter-token latency, end-to-end latency.

Definitions (per request, from the streamed chunks' arrival times):
  TTFT   first chunk holding tokens - send time
  ITL    gap between consecutive token-holding chunks, spread evenly over the tokens of the later
         chunk (a chunk of m tokens after a gap g gives m samples of g / m), pooled over requests
  TPOT   (last chunk - first chunk) / (tokens after the first chunk), one value per request
  E2E    final response - send time
Throughput: output tokens of completed requests / run duration (first send to last response);
requests/s likewise. Percentiles are numpy's (linear interpolation); times are in milliseconds.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional

import numpy as np

from tritium.client.bench.bench_drivers import RequestResult
from tritium.client.bench.bench_runner import RunResult

PERCENTILES = (50, 90, 99)


def distribution(values_s: Iterable[float]) -> Optional[Dict[str, float]]:
    """{"mean", "p50", "p90", "p99", "n"} in milliseconds of values given in seconds; None if empty."""
    v = np.asarray(list(values_s), dtype=np.float64) * 1000.0
    if v.size == 0:
        return None
    out = {"mean": float(v.mean())}
    out.update({f"p{p}": float(x) for p, x in zip(PERCENTILES, np.percentile(v, PERCENTILES))})
    out["n"] = int(v.size)
    return out


def ttft_s(r: RequestResult) -> Optional[float]:
    return r.chunk_times[0] - r.t_send if r.chunk_times else None


def itl_samples_s(r: RequestResult) -> List[float]:
    out: List[float] = []
    for k in range(1, len(r.chunk_times)):
        m = r.chunk_tokens[k]
        out.extend([(r.chunk_times[k] - r.chunk_times[k - 1]) / m] * m)
    return out


def tpot_s(r: RequestResult) -> Optional[float]:
    n = sum(r.chunk_tokens[1:])
    return (r.chunk_times[-1] - r.chunk_times[0]) / n if n > 0 else None


def e2e_s(r: RequestResult) -> Optional[float]:
    return r.t_end - r.t_send if r.t_end is not None else None


def summarize(run: RunResult) -> dict:
    """One run's figures as a JSON-ready dict."""
    ok = [r for r in run.results if r.ok]
    errors = [r for r in run.results if not r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    prompts = [r.num_prompt_tokens for r in ok]
    dur = run.duration_s
    mismatched = [r for r in ok if r.output_tokens != r.max_tokens]
    return {
        "label": run.label, "concurrency": run.concurrency, "request_rate": run.request_rate,
        "num_requests": len(run.results), "completed": len(ok), "errors": len(errors),
        "error_examples": sorted({str(r.error) for r in errors})[:3],
        "count_mismatches": len(mismatched),
        "mismatch_examples": [{"index": r.index, "requested": r.max_tokens, "got": r.output_tokens}
                              for r in mismatched[:3]],
        "requested_tokens": sum(r.max_tokens for r in run.results), "output_tokens": out_tokens,
        "prompt_tokens": sum(prompts) if prompts and None not in prompts else None,
        "duration_s": dur,
        "output_tok_s": out_tokens / dur if dur > 0 else None,
        "request_s": len(ok) / dur if dur > 0 else None,
        "ttft_ms": distribution(x for x in map(ttft_s, ok) if x is not None),
        "itl_ms": distribution(x for r in ok for x in itl_samples_s(r)),
        "tpot_ms": distribution(x for x in map(tpot_s, ok) if x is not None),
        "e2e_ms": distribution(x for x in map(e2e_s, ok) if x is not None),
        "client_cpu_s": run.client_cpu_s,
        "client_cores": run.client_cpu_s / dur if dur > 0 else None,
        **_probed(run),
    }


def _probed(run: RunResult) -> dict:
    """With bandwidth probes (bandwidth_probe.py): each completed request's tok/s (output tokens /
    (final response - send)) and the host's read GB/s just before and after it (with a watching
    probe, each probe's wait and the watched groups' cores: probe_watch), and the probes' time left
    out of duration_s."""
    from tritium.client.bench.bandwidth_probe import request_tok_s
    rows = [{"index": r.index, "tok_s": request_tok_s(r.output_tokens, r.t_send, r.t_end), "probe_gbs": r.probe_gbs,
             **({"probe_watch": r.probe_watch} if r.probe_watch else {})}
            for r in run.results if r.ok and r.probe_gbs is not None]
    return {"probed_requests": rows, "probe_s": run.probe_s} if rows else {}


def ratio(a: Optional[dict], b: Optional[dict], key: str = "output_tok_s") -> Optional[float]:
    """a[key] / b[key], None when either is missing or b is zero."""
    if not a or not b or not a.get(key) or not b.get(key):
        return None
    return a[key] / b[key]


def _pcts(d: Optional[dict], scale: float = 1.0, fmt: str = "{:.0f}") -> str:
    if not d:
        return "-"
    return "/".join(fmt.format(d[f"p{p}"] * scale) for p in PERCENTILES)


HEADER = (f"{'system':<22} {'run':<8} {'conc':>4} {'req':>4} {'err':>3} {'out tok':>7} {'tok/s':>7} "
          f"{'req/s':>6} {'TTFT ms p50/90/99':>19} {'ITL ms p50/90/99':>17} {'E2E s p50/90/99':>16} {'client':>6}")


def format_row(system: str, s: dict) -> str:
    """One table line of a run summary (client = client CPU cores used)."""
    tok_s = f"{s['output_tok_s']:.1f}" if s["output_tok_s"] else "-"
    req_s = f"{s['request_s']:.2f}" if s["request_s"] else "-"
    conc = f"{s['concurrency']}" + ("" if s["request_rate"] is None else f"@{s['request_rate']:g}/s")
    client = f"{s['client_cores']:.2f}" if s["client_cores"] is not None else "-"
    return (f"{system:<22} {s['label']:<8} {conc:>4} {s['num_requests']:>4} {s['errors']:>3} "
            f"{s['output_tokens']:>7} {tok_s:>7} {req_s:>6} {_pcts(s['ttft_ms']):>19} "
            f"{_pcts(s['itl_ms'], 1.0, '{:.1f}'):>17} {_pcts(s['e2e_ms'], 1e-3, '{:.1f}'):>16} {client:>6}")


def warnings_for(system: str, s: dict) -> List[str]:
    """Lines to print under the table: errors and token-count mismatches."""
    out = []
    if s["errors"]:
        out.append(f"{system} {s['label']}: {s['errors']} failed requests, e.g. {s['error_examples'][0]}")
    if s["count_mismatches"]:
        ex = s["mismatch_examples"][0]
        out.append(f"{system} {s['label']}: {s['count_mismatches']} requests returned a different token count "
                   f"than requested (e.g. request {ex['index']}: asked {ex['requested']}, got {ex['got']}); "
                   f"does the server honour ignore_eos?")
    return out
