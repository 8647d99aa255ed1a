"""`tritium bench`: serving benchmark of Tritium (and any OpenAI-compatible server), streaming.

Systems (give one or more; each runs the identical workload, interleaved run by run):
  --url HOST:PORT --model NAME   a Tritium model on tritonserver: --triton-protocol http (default)
                                 reads Triton's HTTP generate_stream (server-sent events) with the
                                 same client as --openai-url, --url the HTTP port; grpc uses
                                 tritonclient's gRPC stream, --url the gRPC port
  --openai-url URL               any OpenAI-compatible /v1/completions with stream: true
                                 (e.g. llama.cpp's llama-server), ignore_eos sent
  --engine DIR                   the same engine in this process through AsyncLLMEngine
                                 (with a server system too: server / in-process = its overhead)
Workload (seeded, fixed): prompts of 12-384 words of shipped prose, 16-256 output tokens, greedy
with EOS ignored; 32 requests at concurrency 16 (--concurrency 1,4,16,64 sweeps; --request-rate R
sends them as a seeded Poisson process), then 3 requests one at a time with 128 output tokens
after a 12-word (~16-token) prompt. Reports output tok/s, requests/s, TTFT, inter-token latency,
TPOT and end-to-end latency (p50/p90/p99), errors, token counts and the client's CPU use.

`tritium bench --engine DIR --hf-baselines` is the offline comparison of the engine with
Hugging Face transformers `generate` (see tritium/client/bench_hf.py).
"""
from __future__ import annotations

import argparse
import json
import sys

from tritium.client.bench.bench_workload import WorkloadSpec, parse_concurrency

# How `tritium bench --url` and `tritium compare` read Tritium (--triton-protocol): by default with
# the same kind of client as llama-server (docs/benchmarks.md#server-overhead-per-token).
DEFAULT_PROTOCOL = "http"

_HF_ONLY = ("hf_model", "hf_batch_size", "hf_sequential_requests", "prompt_len")


def register(sub) -> None:
    p = sub.add_parser("bench", help="serving benchmark: Triton HTTP SSE or gRPC, OpenAI SSE or in-process (or vs HF)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("systems")
    g.add_argument("--url", default=None, help="tritonserver HOST:PORT: its HTTP port (e.g. 127.0.0.1:8000), or "
                                               "with --triton-protocol grpc its gRPC port (e.g. 127.0.0.1:8001)")
    g.add_argument("--model", default="smollm2", help="Triton model name with --url (default smollm2)")
    g.add_argument("--triton-protocol", default=DEFAULT_PROTOCOL, choices=("http", "grpc"),
                   help=f"how --url is read (default {DEFAULT_PROTOCOL}): http = Triton's generate_stream SSE, "
                        "the same client as --openai-url; grpc = tritonclient's gRPC stream")
    g.add_argument("--openai-url", default=None,
                   help="OpenAI-compatible server, http://HOST:PORT[/v1[/completions]]")
    g.add_argument("--openai-model", default=None, help="model name sent to it (default: first of /v1/models)")
    g.add_argument("--api-key", default=None,
                   help="the servers' API key (tritium serve --api-key), sent as 'Authorization: Bearer KEY' to "
                        "--url (HTTP and gRPC) and --openai-url (default: $TRITIUM_API_KEY)")
    g.add_argument("--engine", default=None, help="engine directory: run it in-process too")
    w = p.add_argument_group("workload")
    w.add_argument("--num-requests", type=int, default=None, help="requests per run (default 32; 64 with "
                                                                  "--hf-baselines)")
    w.add_argument("--prompt-words", type=int, nargs=2, default=[12, 384], metavar=("MIN", "MAX"),
                   help="prompt length range in words (default 12 384)")
    w.add_argument("--output-len", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"),
                   help="output tokens range (default 16 256)")
    w.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    w.add_argument("--concurrency", default="16", help="requests in flight; a list sweeps, e.g. 1,4,16,64 "
                                                       "(default 16)")
    w.add_argument("--request-rate", type=float, default=None,
                   help="Poisson arrivals at R requests/s (seeded), capped by --concurrency (default: all at once)")
    w.add_argument("--single-stream", type=int, default=3, help="requests sent one at a time after the "
                                                                "workload (default 3; 0 = none)")
    w.add_argument("--single-stream-words", type=int, default=12, help="their prompt words (default 12)")
    w.add_argument("--single-stream-tokens", type=int, default=128, help="their output tokens (default 128)")
    w.add_argument("--warmup", type=int, default=2, help="unmeasured requests per system first (default 2)")
    w.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for a response (default 600)")
    w.add_argument("--client-nice", type=int, default=0, metavar="N",
                   help="run the benchmark's client threads (its workers and the threads their sessions start) "
                        "at nice N, 1-19, for every system alike: a client that yields the cores to the server, "
                        "as a remote one would (default 0: as started)")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print one JSON object on stdout (the table goes to stderr)")
    o.add_argument("--plot", default=None, metavar="DIR", help="write PNG plots (matplotlib) into DIR")
    o.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    from tritium.client.bench.bandwidth_probe import add_probe_flags
    add_probe_flags(o)
    o.add_argument("--bandwidth-mb", type=int, default=256,
                   help="buffer for the host's memory-bandwidth measurement, printed first and under 'host' "
                        "in --json (default 256 MB; 0 skips it)")
    o.add_argument("--served-engine", default=None, metavar="DIR",
                   help="the engine the --url server runs: its weight bytes give that system's single-stream "
                        "bandwidth share (default: --engine's)")
    e = p.add_argument_group("in-process engine (--engine)")
    e.add_argument("--threads", type=int, default=None, help="torch intra-op threads in this process")
    e.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    e.add_argument("--num-kv-blocks", type=int, default=None)
    e.add_argument("--max-num-seqs", type=int, default=None)
    e.add_argument("--max-num-batched-tokens", type=int, default=None)
    h = p.add_argument_group("HF baselines (--engine DIR --hf-baselines)")
    h.add_argument("--hf-baselines", action="store_true",
                   help="instead: offline engine throughput vs HF transformers generate")
    h.add_argument("--hf-model", default=None,
                   help="HF checkpoint folder or .gguf file for the baselines (default: the engine's build source)")
    h.add_argument("--prompt-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"),
                   help="prompt length range in random tokens (default 16 512)")
    h.add_argument("--hf-batch-size", type=int, default=None, help="static batch size of the HF baseline (16)")
    h.add_argument("--hf-sequential-requests", type=int, default=None,
                   help="run the one-at-a-time HF baseline on only the first N requests")
    h.add_argument("--skip-hf", action="store_true", help="only run Tritium's offline engine")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    if args.hf_baselines:
        return _run_hf(args)
    for name in _HF_ONLY:
        if getattr(args, name) is not None:
            raise ValueError(f"--{name.replace('_', '-')} needs --hf-baselines")
    if not (args.url or args.openai_url or args.engine):
        raise ValueError("give a system: --url HOST:PORT, --openai-url URL and/or --engine DIR")
    from tritium.client.bench.bench_suite import SuiteOptions, run_suite
    opts = SuiteOptions(WorkloadSpec(args.num_requests or 32, tuple(args.prompt_words), tuple(args.output_len),
                                     args.seed),
                        parse_concurrency(args.concurrency), args.request_rate, args.single_stream,
                        args.single_stream_words, args.single_stream_tokens, args.warmup,
                        progress=not args.no_progress, client_nice=args.client_nice)
    opts.validate()
    if args.bandwidth_mb < 0:
        raise ValueError(f"--bandwidth-mb must be >= 0 (0 skips the measurement), got {args.bandwidth_mb}")
    from tritium.client.bench.bandwidth_probe import check_probe_flags
    check_probe_flags(args)
    if args.served_engine is not None:
        import os
        if not args.url:
            raise ValueError("--served-engine names the engine of the --url server: give --url too")
        if not os.path.isfile(os.path.join(args.served_engine, "engine.json")):
            raise ValueError(f"--served-engine {args.served_engine}: not an engine folder (no engine.json)")
    targets = make_targets(args)
    host = measure_host(args)
    from tritium.client.bench.bandwidth_probe import probe_for_host, shares_of_run
    probe = probe_for_host(host) if opts.single_stream else None
    from tritium.client.bench.bandwidth_probe import watch_probe
    watch_probe(probe, args, {})  # this process (the in-process engine); a --url server is not seen
    try:
        result, raw = run_suite(targets, opts, probe=probe)
    finally:
        for d in targets.values():
            d.close()
    result["host"] = host
    if probe is not None:
        result["bandwidth_probe"] = probe.describe()
        result["bandwidth_share"] = shares_of_run(result["runs"], weight_bytes_of(args, targets),
                                                  host["memory"]["read_gbs"])
    if args.url:
        result["triton_protocol"] = args.triton_protocol
    out = sys.stderr if args.json else sys.stdout
    print_result(result, out)
    if args.plot:
        from tritium.client.bench.bench_plots import write_plots
        result["plots"] = write_plots(args.plot, raw)
        print(f"plots: {', '.join(result['plots'])}", file=out)
    if args.json:
        print(json.dumps(result, sort_keys=True))
    sys.stdout.flush()
    return 0


def make_targets(args) -> dict:
    """{name: driver} for the systems given on the command line, each checked to answer."""
    from tritium.client.bench import bench_drivers as bd
    from tritium.client.bench import bench_openai as bo
    from tritium.client.bench.bench_triton_http import make_triton_driver
    from tritium.client.security import API_KEY_ENV, check_key
    targets = {}
    key = check_key(api_key_of(args), f"--api-key / ${API_KEY_ENV}")
    if args.url:
        targets[f"tritium-{args.triton_protocol}"] = make_triton_driver(args.triton_protocol, args.url, args.model,
                                                                         args.timeout, api_key=key)
    if args.openai_url:
        targets["openai"] = bo.OpenAIDriver(args.openai_url, args.openai_model, args.timeout, api_key=key)
    for d in targets.values():
        d.check()
    if args.engine:
        import torch
        if args.threads is not None:
            torch.set_num_threads(args.threads)
        targets["in-process"] = bd.InProcessDriver(
            args.engine, num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, device=args.device)
    return targets


def api_key_of(args):
    """--api-key, else $TRITIUM_API_KEY (the variable `tritium serve` reads), else None."""
    import os

    from tritium.client.security import API_KEY_ENV
    key = getattr(args, "api_key", None)
    return key if key is not None else (os.environ.get(API_KEY_ENV) or None)


def weight_bytes_of(args, targets: dict) -> dict:
    """{system: the weight bytes its engine streams per token} where known: in-process --engine,
    the --url system --served-engine (else --engine's, the same engine served)."""
    from tritium.client.bench.host_info import engine_weight_bytes
    out = {}
    if args.engine:
        out["in-process"] = engine_weight_bytes(args.engine)
    served = args.served_engine or args.engine
    if served:
        for name in targets:
            if name.startswith("tritium-"):
                out[name] = engine_weight_bytes(served)
    return out


def measure_host(args) -> dict:
    """CPU model, ISA path, cores and memory bandwidth (with the in-process thread count), and with
    --engine the single-stream decode limit that bandwidth sets for its weights."""
    import torch

    from tritium.client.bench import host_info
    host = host_info.host_report(torch.get_num_threads(), args.bandwidth_mb)
    if args.engine and "memory" in host:
        nbytes = host_info.engine_weight_bytes(args.engine)
        host["engine_weight_bytes"] = nbytes
        host["bandwidth_limit_tok_s"] = host_info.bandwidth_limit_tok_s(host["memory"]["read_gbs"], nbytes)
    return host


def print_result(result: dict, out) -> None:
    """The human-readable table, warnings and ratios."""
    from tritium.client.bench.bench_report import HEADER, format_row, warnings_for
    from tritium.client.bench.host_info import format_host
    if result.get("host"):
        print(format_host(result["host"]), file=out)
        h = result["host"]
        if h.get("bandwidth_limit_tok_s"):
            print(f"single-stream limit of the in-process engine: {h['bandwidth_limit_tok_s']:.0f} tok/s (memory "
                  f"read {h['memory']['read_gbs']:.1f} GB/s / {h['engine_weight_bytes'] / 1e6:.0f} MB of weights "
                  f"per token)", file=out)
    if result.get("triton_protocol"):
        print(f"tritium read over {result['triton_protocol']} ("
              f"{'generate_stream SSE' if result['triton_protocol'] == 'http' else 'tritonclient gRPC stream'})",
              file=out)
    wl = result["workload"]
    print(f"workload: {wl['num_requests']} requests, prompts {wl['prompt_words'][0]}-{wl['prompt_words'][1]} "
          f"words, outputs {wl['output_tokens'][0]}-{wl['output_tokens'][1]} tokens (seed {wl['seed']}), EOS "
          f"ignored; single stream: {wl['single_stream']} x {wl['single_stream_tokens']} tokens", file=out)
    print(HEADER, file=out)
    notes = []
    for system, runs in result["runs"].items():
        for s in runs:
            print(format_row(system, s), file=out)
            notes += warnings_for(system, s)
    for line in notes:
        print("warning: " + line, file=out)
    shares = result.get("bandwidth_share") or {}
    if shares:
        print("single-stream bandwidth share (request tok/s x weight bytes / the host's read probed just before "
              "and after each request, median over the requests):", file=out)
        from tritium.client.bench.bandwidth_probe import format_share
        for system, s in shares.items():
            print("  " + format_share(system, s), file=out)
    r = result["ratios"]
    for system, by_label in r.items():
        if system != "reference":
            figs = ", ".join(f"{label} {v:.2f}x" for label, v in by_label.items() if v is not None)
            print(f"output tok/s {system} / {r['reference']}: {figs}", file=out)
    out.flush()


def _run_hf(args) -> int:
    if not args.engine or args.url or args.openai_url:
        raise ValueError("--hf-baselines needs --engine DIR and takes no --url / --openai-url")
    from tritium.client.bench.bench_hf import run_hf_baselines
    args.num_requests = args.num_requests or 64
    args.prompt_len = args.prompt_len or [16, 512]
    args.hf_batch_size = args.hf_batch_size or 16
    return run_hf_baselines(args)
