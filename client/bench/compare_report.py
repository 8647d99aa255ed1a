"""The side-by-side table of `tritium compare`: every system's figures per pair, and the ratios."""
from __future__ import annotations

from typing import Dict, List, Optional

# pair -> (the Tritium engine's build options, llama.cpp's type). int8 / int4 are the default
# builds (W8A8 / W4A8: --activation-quant auto); int8-wo / int4-wo the same weights weight-only.
PAIRS = {"bf16": ({"dtype": "bfloat16", "quantization": "none"}, "BF16"),
         "int8": ({"dtype": "bfloat16", "quantization": "int8"}, "Q8_0"),
         "int4": ({"dtype": "bfloat16", "quantization": "int4-rtn"}, "Q4_0"),
         "int8-wo": ({"dtype": "bfloat16", "quantization": "int8", "activation_quant": "none"}, "Q8_0"),
         "int4-wo": ({"dtype": "bfloat16", "quantization": "int4-rtn", "activation_quant": "none"}, "Q4_0")}

WEIGHTS = {"bf16": "bf16", "int8": "int8 W8A8", "int4": "int4-rtn W4A8", "int8-wo": "int8 W8A16",
           "int4-wo": "int4-rtn W4A16"}


def _mean(xs: List[Optional[float]]) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _div(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def pair_shares(reps: List[dict], weight_bytes: Optional[int], read_gbs: Optional[float]) -> dict:
    """The single-stream bandwidth share of a pair's Tritium systems (bandwidth_probe.py): the
    same-second share over every probed request of every repeat, and the start-of-run figure from
    the mean single-stream tok/s."""
    from tritium.client.bench.bandwidth_probe import shares_of_run
    if not weight_bytes:
        return {}
    merged = {}
    for system in ("tritium-serve", "in-process"):
        singles = [s for r in reps for s in r["runs"].get(system, []) if s["label"] == "single"]
        if singles:
            merged[system] = [{"label": "single", "output_tok_s": _mean([s["output_tok_s"] for s in singles]),
                               "probed_requests": [p for s in singles for p in s.get("probed_requests", [])]}]
    out = shares_of_run(merged, {n: weight_bytes for n in merged}, read_gbs)
    for system, sh in out.items():  # each request's tok/s and probes, every repeat's, in the JSON
        sh["probed_requests"] = merged[system][0]["probed_requests"]
    return out


def summary(results: Dict[str, dict], pairs: List[str]) -> dict:
    """JSON-ready figures: per pair and system, per run label, output tok/s (mean over repeats,
    each repeat listed), p50 TTFT / ITL / E2E (mean over repeats), errors and count mismatches;
    with a pair's "weight_bytes" and "read_gbs" its single-stream bandwidth shares (pair_shares)."""
    out = {"pairs": {}}
    for kind in pairs:
        reps = results[kind]["reps"]
        figs: Dict[str, Dict[str, dict]] = {}
        for system in reps[0]["runs"]:
            figs[system] = {}
            for label in [s["label"] for s in reps[0]["runs"][system]]:
                runs = [next(s for s in r["runs"][system] if s["label"] == label) for r in reps]
                figs[system][label] = {
                    "output_tok_s": _mean([s["output_tok_s"] for s in runs]),
                    "output_tok_s_repeats": [s["output_tok_s"] for s in runs],
                    "output_tokens": runs[0].get("output_tokens"),
                    "ttft_p50_ms": _mean([(s["ttft_ms"] or {}).get("p50") for s in runs]),
                    "itl_p50_ms": _mean([(s["itl_ms"] or {}).get("p50") for s in runs]),
                    "itl_p99_ms": _mean([(s["itl_ms"] or {}).get("p99") for s in runs]),
                    "e2e_p50_ms": _mean([(s["e2e_ms"] or {}).get("p50") for s in runs]),
                    "errors": sum(s["errors"] for s in runs),
                    "count_mismatches": sum(s["count_mismatches"] for s in runs),
                    "client_cores": _mean([s["client_cores"] for s in runs])}
        tok = {s: {lab: f["output_tok_s"] for lab, f in by.items()} for s, by in figs.items()}
        llamas = [n for n in tok if n.startswith("llama-server")]
        best = {lab: max((tok[n].get(lab) or 0.0 for n in llamas), default=None) for lab in tok["tritium-serve"]}
        ratios = {"tritium_vs_llama": {lab: _div(v, best[lab]) for lab, v in tok["tritium-serve"].items()}}
        if "in-process" in tok:
            ratios["serve_vs_in_process"] = {lab: _div(v, tok["in-process"].get(lab))
                                             for lab, v in tok["tritium-serve"].items()}
        out["pairs"][kind] = {"weights": {"llama-server": PAIRS[kind][1], "tritium": WEIGHTS[kind]},
                              "figures": figs, "ratios": ratios,
                              "idle_server_cores": results[kind]["idle_server_cores"],
                              "host_load": results[kind].get("host_load"),
                              "llama_server_args": results[kind]["llama_server_cmd"],
                              "best_llama": {lab: next((n for n in llamas if tok[n].get(lab) == b), None)
                                             for lab, b in best.items()},
                              "bandwidth_share": pair_shares(reps, results[kind].get("weight_bytes"),
                                                             results[kind].get("read_gbs"))}
    if "bf16" in pairs and len(pairs) > 1:
        base = out["pairs"]["bf16"]["figures"]
        out["quantized_vs_bf16"] = {
            system: {kind: {lab: _div(f["output_tok_s"], base[system][lab]["output_tok_s"])
                            for lab, f in out["pairs"][kind]["figures"][system].items()}
                     for kind in pairs if kind != "bf16"}
            for system in base}
    return out


def _f(x: Optional[float], fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def format_table(report: dict) -> str:
    """Plain-text table: one row per (pair, system), then the ratios."""
    pairs = report["pairs"]
    labels = list(next(iter(next(iter(pairs.values()))["figures"].values())))
    head = f"{'pair':<7} {'system':<17} {'weights':<14}" + "".join(
        f" {lab + ' tok/s':>12} {lab + ' TTFT ms':>13} {lab + ' ITL ms':>17}" for lab in labels) + "  errors"
    lines = [head]
    for kind, p in pairs.items():
        for system, by in p["figures"].items():
            w = p["weights"]["llama-server" if system.startswith("llama-server") else "tritium"]
            row = f"{kind:<7} {system:<17} {w:<14}"
            for lab in labels:
                f = by[lab]
                itl = f"{_f(f['itl_p50_ms'])} / {_f(f.get('itl_p99_ms'), '{:.0f}')}"
                row += f" {_f(f['output_tok_s']):>12} {_f(f['ttft_p50_ms'], '{:.0f}'):>13} {itl:>17}"
            errs = sum(f["errors"] for f in by.values())
            mism = sum(f["count_mismatches"] for f in by.values())
            lines.append(row + f"  {errs}" + (f" ({mism} token-count mismatches)" if mism else ""))
    lines.append("(tok/s: output tokens/s, mean over repeats; TTFT: p50; ITL: p50 / p99, a large p99 = stalls)")
    lines.append("ratios of output tok/s:")
    for kind, p in pairs.items():
        for name, by in p["ratios"].items():
            what = {"tritium_vs_llama": "tritium serve / best llama",
                    "serve_vs_in_process": "tritium serve / in-process"}[name]
            lines.append(f"  {kind:<5} {what:<27} " + ", ".join(f"{lab} {_f(v, '{:.2f}x')}" for lab, v in by.items()))
        lines.append(f"  {kind:<5} {'best llama':<27} " + ", ".join(f"{lab} {n}" for lab, n in p["best_llama"].items()))
    for system, by_kind in report.get("quantized_vs_bf16", {}).items():
        for kind, by in by_kind.items():
            lines.append(f"  {system} {kind} / bf16: " + ", ".join(f"{lab} {_f(v, '{:.2f}x')}"
                                                                    for lab, v in by.items()))
    shares = [(kind, system, sh) for kind, p in pairs.items() for system, sh in p.get("bandwidth_share", {}).items()]
    if shares:
        from tritium.client.bench.bandwidth_probe import format_share
        lines.append("single-stream bandwidth share (request tok/s x weight bytes / the host's read probed just "
                     "before and after each request, median over the requests):")
        lines += [f"  {kind:<5} " + format_share(system, sh) for kind, system, sh in shares]
    idle = ", ".join(f"{kind}: " + " / ".join(f"{s} {c:.3f}" for s, c in p["idle_server_cores"].items())
                     for kind, p in pairs.items())
    lines.append(f"idle servers' CPU (cores, 5 s before measuring): {idle}")
    loads = ", ".join(f"{kind} {p['host_load'][0]:.1f} -> {p['host_load'][-1]:.1f}"
                      for kind, p in pairs.items() if p.get("host_load"))
    if loads:
        lines.append(f"host 1-minute load average before -> after each pair (2 cores): {loads}")
    return "\n".join(lines)
