"""PNG plots of a serving benchmark (matplotlib, Agg backend; `pip install tritium[bench]`).

throughput_vs_concurrency.png  output tok/s per concurrency, one line per system (workload runs;
                               the single-stream run is a different workload and is left out)
ttft_cdf.png                   cumulative distribution of TTFT, one curve per system and run
itl_cdf.png                    cumulative distribution of inter-token latency, likewise
"""
from __future__ import annotations

import os
from typing import Dict, List, Tuple

import numpy as np

from tritium.client.bench.bench_report import itl_samples_s, summarize, ttft_s
from tritium.client.bench.bench_runner import RunResult


def write_plots(out_dir: str, runs: Dict[str, List[RunResult]]) -> List[str]:
    """Write the three PNGs for {system: [RunResult, ...]} into out_dir; returns their paths."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise OSError("--plot needs matplotlib: pip install 'tritium[bench]' (or pip install matplotlib)") \
            from None
    os.makedirs(out_dir, exist_ok=True)
    paths = []

    fig, ax = plt.subplots(figsize=(6, 4))
    for system, rs in runs.items():
        pts: List[Tuple[int, float]] = sorted(
            (r.concurrency, summarize(r)["output_tok_s"] or 0.0) for r in rs
            if r.request_rate is None and r.label != "single")  # single stream: another workload
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=system)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("output tokens / s")
    ax.set_title("Throughput vs concurrency")
    ax.grid(True, alpha=0.3)
    ax.legend()
    paths.append(_save(fig, out_dir, "throughput_vs_concurrency.png"))

    for name, title, xlabel, samples in (
            ("ttft_cdf.png", "Time to first token", "TTFT (ms)",
             lambda r: [x for x in map(ttft_s, r.results) if x is not None]),
            ("itl_cdf.png", "Inter-token latency", "ITL (ms)",
             lambda r: [x for q in r.results for x in itl_samples_s(q)])):
        fig, ax = plt.subplots(figsize=(6, 4))
        for system, rs in runs.items():
            for r in rs:
                v = np.sort(np.asarray(samples(r)) * 1000.0)
                if v.size:
                    ax.step(v, np.arange(1, v.size + 1) / v.size, where="post", label=f"{system} {r.label}")
        ax.set_xscale("log")  # latency tails span orders of magnitude
        ax.set_xlabel(xlabel + ", log scale")
        ax.set_ylabel("fraction of samples <= x")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
        paths.append(_save(fig, out_dir, name))
    return paths


def _save(fig, out_dir: str, name: str) -> str:
    import matplotlib.pyplot as plt
    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
