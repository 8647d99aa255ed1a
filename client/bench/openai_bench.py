"""`tritium bench-openai --url http://HOST:PORT --model NAME --tokenizer DIR`: NVIDIA's aiperf
against the OpenAI-compatible API (chat endpoint, streaming), one run per --concurrency value.

aiperf (`pip install aiperf`, or the `aiperf` extra; a venv of its own is fine: pass --aiperf
PATH) sends synthetic prompts of --input-tokens tokens asking for --output-tokens tokens
(`ignore_eos`, so every answer has that length), measures time to first token, inter-token latency
and throughput on the client side, and counts tokens with the server's `usage`
(--use-server-token-count; our counts are the engine's). This command prints one markdown row per
run from aiperf's JSON export (profile_export_aiperf.json). --tokenizer is a local folder with
tokenizer.json (an engine folder will do): aiperf uses it to make prompts of the right length.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import List

COLUMNS = ("concurrency", "requests", "TTFT avg / p50 / p99 (ms)", "ITL avg / p50 / p99 (ms)",
           "output tok/s", "req/s", "tok/s per user")


def register(sub) -> None:
    p = sub.add_parser("bench-openai", help="benchmark the OpenAI-compatible API with NVIDIA aiperf",
                       description="Run aiperf (chat endpoint, streaming) against the OpenAI API and print a "
                                   "TTFT / ITL / throughput table.")
    p.add_argument("--url", required=True, help="the OpenAI API's base URL, e.g. http://127.0.0.1:9000 (/v1 optional)")
    p.add_argument("--model", required=True, help="model id (GET /v1/models)")
    p.add_argument("--tokenizer", required=True, help="local folder with tokenizer.json, e.g. the engine folder")
    p.add_argument("--concurrency", default="1,4", help="comma-separated concurrent requests, one run each "
                                                        "(default 1,4)")
    p.add_argument("--requests", type=int, default=None,
                   help="requests per run (default: 4 x concurrency, at least 8)")
    p.add_argument("--input-tokens", type=int, default=128, help="prompt length in tokens (default 128)")
    p.add_argument("--output-tokens", type=int, default=64, help="answer length in tokens (default 64)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up requests before each run (default 2)")
    p.add_argument("--api-key", default=None, help="the server's API key (tritium serve / tritium openai --api-key), "
                                                   "passed to aiperf's --api-key, sent as 'Authorization: Bearer KEY' "
                                                   "(default: $TRITIUM_API_KEY)")
    p.add_argument("--aiperf", default="aiperf", help="the aiperf executable (default: aiperf on PATH)")
    p.add_argument("--artifact-dir", default=None, help="keep aiperf's files here (default: a temporary folder)")
    p.set_defaults(func=run)


def _concurrencies(text: str) -> List[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--concurrency must be comma-separated integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise ValueError(f"--concurrency values must be >= 1, got {text!r}")
    return vals


def aiperf_command(args, concurrency: int, requests: int, out_dir: str) -> List[str]:
    base = args.url.rstrip("/")
    base = base[:-3] if base.endswith("/v1") else base
    return [args.aiperf, "profile", "--model", args.model, "--url", base, "--endpoint-type", "chat", "--streaming",
            "--tokenizer", os.path.abspath(args.tokenizer), "--concurrency", str(concurrency),
            "--request-count", str(requests), "--warmup-request-count", str(args.warmup),
            "--isl", str(args.input_tokens), "--isl-stddev", "0", "--osl", str(args.output_tokens),
            "--osl-stddev", "0", "--extra-inputs", "ignore_eos:true", "--use-server-token-count",
            "--random-seed", "0", "--ui-type", "none", "--no-server-metrics", "--no-gpu-telemetry",
            "--output-artifact-dir", out_dir] + _key_args(args)


def _key_args(args) -> List[str]:
    """aiperf's --api-key with --api-key, else $TRITIUM_API_KEY; nothing without a key."""
    from tritium.client.security import API_KEY_ENV
    key = getattr(args, "api_key", None)
    key = key if key is not None else os.environ.get(API_KEY_ENV)
    return ["--api-key", key] if key else []


def summarize(export: dict, concurrency: int) -> dict:
    """The table's numbers from aiperf's profile_export_aiperf.json."""
    def stat(name, key):
        m = export.get(name) or {}
        if key not in m:
            raise ValueError(f"aiperf's export has no {name}.{key} (aiperf version {export.get('aiperf_version')})")
        return float(m[key])
    return {"concurrency": concurrency, "requests": int(stat("request_count", "avg")),
            "ttft": (stat("time_to_first_token", "avg"), stat("time_to_first_token", "p50"),
                     stat("time_to_first_token", "p99")),
            "itl": (stat("inter_token_latency", "avg"), stat("inter_token_latency", "p50"),
                    stat("inter_token_latency", "p99")),
            "output_tps": stat("output_token_throughput", "avg"), "rps": stat("request_throughput", "avg"),
            "tps_user": stat("output_token_throughput_per_user", "avg")}


def markdown(rows: List[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        lines.append("| {} | {} | {:.0f} / {:.0f} / {:.0f} | {:.1f} / {:.1f} / {:.1f} | {:.1f} | {:.2f} | {:.1f} |".format(
            r["concurrency"], r["requests"], *r["ttft"], *r["itl"], r["output_tps"], r["rps"], r["tps_user"]))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    concs = _concurrencies(args.concurrency)
    for name in ("input_tokens", "output_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.requests is not None and args.requests < 1:
        raise ValueError(f"--requests must be >= 1, got {args.requests}")
    if not os.path.isfile(os.path.join(args.tokenizer, "tokenizer.json")):
        raise ValueError(f"--tokenizer {args.tokenizer}: no tokenizer.json there (give an engine folder)")
    exe = shutil.which(args.aiperf)
    if exe is None:
        raise OSError(f"aiperf not found ({args.aiperf!r}); `pip install aiperf` (or "
                      f"pip install 'tritium[aiperf]'), or give its path with --aiperf")
    args.aiperf = exe
    root = args.artifact_dir or tempfile.mkdtemp(prefix="tritium-aiperf-")
    rows = []
    for c in concs:
        n = args.requests or max(8, 4 * c)
        out_dir = os.path.join(root, f"c{c}")
        cmd = aiperf_command(args, c, n, out_dir)
        shown = ["***" if i and cmd[i - 1] == "--api-key" else x for i, x in enumerate(cmd)]  # never print the key
        print(f"bench-openai: concurrency {c}, {n} requests: {' '.join(shown)}", file=sys.stderr, flush=True)
        log = os.path.join(root, f"c{c}.log")
        os.makedirs(root, exist_ok=True)
        with open(log, "w") as fh:
            rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT).returncode
        export = os.path.join(out_dir, "profile_export_aiperf.json")
        if rc != 0 or not os.path.isfile(export):
            raise OSError(f"aiperf failed (exit {rc}); its log: {log}")
        with open(export) as f:
            data = json.load(f)
        if data.get("error_summary"):
            raise OSError(f"aiperf reported failed requests: {json.dumps(data['error_summary'])[:500]} (log: {log})")
        rows.append(summarize(data, c))
    print(markdown(rows))
    print(f"aiperf artifacts: {root}", file=sys.stderr)
    return 0
