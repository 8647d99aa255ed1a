"""`tritium compare`: Tritium side by side with llama.cpp's llama-server, matched bits, one run.

For each pair (Tritium bf16 vs llama.cpp BF16, int8 W8A8 vs Q8_0, int4-rtn W4A8 vs Q4_0; int8-wo / int4-wo:
the weight-only engines of the same weights, on request):
  1. the GGUF (default SmolLM2-135M-Instruct Q4_1) is requantized with `llama-quantize
     --allow-requantize` (cached) and the Tritium engine built with `tritium build` (cached);
  2. llama-server (`-np P -c P*2048 -t T -tb T`: P slots of 2048 tokens, Tritium's max_seq_len;
     one server per --llama-threads value T, default 1 and 2) and `tritium serve`'s tritonserver
     on that engine start on free ports, and the engine is also loaded in this process
     (AsyncLLMEngine, --threads torch threads);
  3. `tritium bench`'s suite runs on every system (tritium serve read over --triton-protocol: by
     default Triton's HTTP generate_stream, by the SSE client that reads llama-server): warm-up,
     the workload (32 requests at concurrency 16), then 3 single streams of 128 tokens. Every run
     goes to each system before the next run starts, the order flipping between runs and between
     pairs, so host drift favours none; the servers wait idle while another system is measured
     (their idle CPU is measured and printed);
  4. the servers stop (always: try/finally), and the next pair starts.
It prints the host first (CPU model, the ISA path Tritium's kernels take, cores, and the memory
bandwidth measured with --threads threads, with each engine's single-stream decode limit: read
GB/s / its weight bytes), then one table with every system's figures and the ratios: Tritium /
the fastest llama-server, tritium serve / in-process (server overhead) and each quantized pair /
bf16; and the single streams' bandwidth share, against the host's read probed just before and
after each request (client/bench/bandwidth_probe.py), beside the start-of-run figure. `--isa
avx2` (or avx512, generic) runs both sides on that instruction set: llama.cpp built with
GGML_NATIVE=OFF and that ISA's options (client/bench/llamacpp.py), Tritium with TRITIUM_CPU_ISA
forced; so an AVX2 comparison can be made on an AVX-512 host.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time

from tritium.client.bench.bench_workload import WorkloadSpec, parse_concurrency
from tritium.client.bench.compare_report import PAIRS, format_table, summary
from tritium.client.cli.bench_cli import DEFAULT_PROTOCOL

MODEL = "smollm2"


def register(sub) -> None:
    p = sub.add_parser("compare", help="side-by-side serving benchmark: tritium serve vs llama.cpp llama-server",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-cpp-dir", default=None, help="an existing llama.cpp build (the folder holding "
                   "build/bin/llama-server; or $TRITIUM_LLAMA_CPP_DIR); default: build it once into the cache")
    p.add_argument("--gguf", default=None, help="source GGUF (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--engines-dir", default=None, help="folder of prebuilt engines named after the pairs (bf16/ "
                   "int8/ int4/ int8-wo/ int4-wo/; default: <cache>/compare/engines, built when missing)")
    p.add_argument("--pairs", default="bf16,int8,int4",
                   help="which pairs, in order (default bf16,int8,int4): int8 / int4 are the default builds, W8A8 / "
                        "W4A8; int8-wo / int4-wo the same weights weight-only (--activation-quant none)")
    p.add_argument("--repeats", type=int, default=1, help="suite repetitions per pair (default 1)")
    p.add_argument("--threads", type=int, default=2, help="llama-server -t/-tb and in-process torch threads "
                                                          "(default 2)")
    p.add_argument("--llama-threads", default="1,2",
                   help="llama-server -t/-tb; a comma list runs one llama-server per value and the ratios use "
                        "the fastest (default 1,2: -t 2 is faster on a quiet host, -t 1 on a busy one; see docs)")
    p.add_argument("--isa", default="native",
                   help="instruction set of both sides: native (llama.cpp GGML_NATIVE=ON, Tritium's best path; "
                        "default), avx512, avx2 or generic (forced: llama.cpp built for it into build-<isa>/, "
                        "TRITIUM_CPU_ISA set)")
    p.add_argument("--bandwidth-mb", type=int, default=256,
                   help="buffer for the memory-bandwidth measurement (default 256 MB; 0 skips it)")
    from tritium.client.bench.bandwidth_probe import add_probe_flags
    add_probe_flags(p)
    p.add_argument("--llama-server-args", default="", metavar="ARGS",
                   help='extra llama-server arguments, one string (e.g. "--poll 0")')
    p.add_argument("--triton-protocol", default=DEFAULT_PROTOCOL, choices=("http", "grpc"),
                   help=f"how tritium serve is read (default {DEFAULT_PROTOCOL}): http = Triton's generate_stream "
                        "SSE on tritonserver's own HTTP port, the client that reads llama-server; grpc = "
                        "tritonclient's gRPC stream")
    p.add_argument("--api-key", default=None,
                   help="serve both systems with this API key and send it (tritium serve's --api-key, llama-server's "
                        "$LLAMA_API_KEY): the keyed path a deployment runs (default: $TRITIUM_API_KEY; none: open)")
    p.add_argument("--client-nice", type=int, default=0, metavar="N",
                   help="the benchmark's client threads at nice N (1-19) for every system (default 0)")
    p.add_argument("--no-in-process", action="store_true", help="skip the in-process engine (no overhead ratio)")
    p.add_argument("--num-requests", type=int, default=32, help="requests per run (default 32)")
    p.add_argument("--concurrency", default="16", help="comma list (default 16)")
    p.add_argument("--prompt-words", type=int, nargs=2, default=[12, 384], metavar=("MIN", "MAX"),
                   help="prompt words (default 12 384)")
    p.add_argument("--output-len", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"),
                   help="output tokens (default 16 256)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument("--single-stream", type=int, default=3, help="one-at-a-time requests (default 3)")
    p.add_argument("--single-stream-tokens", type=int, default=128, help="their output tokens (default 128)")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured requests per system (default 2)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout (the table to stderr)")
    p.add_argument("--plot", default=None, metavar="DIR", help="PNG plots per pair into DIR/<pair>/")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=run)


def parse_pairs(text: str) -> list:
    pairs = [x.strip() for x in text.split(",") if x.strip()]
    if not pairs or any(x not in PAIRS for x in pairs) or len(set(pairs)) != len(pairs):
        raise ValueError(f"--pairs must be a comma list of distinct {', '.join(PAIRS)}, got {text!r}")
    return pairs


def parse_threads(text: str) -> list:
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values) or len(set(values)) != len(values):
        raise ValueError(f"--llama-threads must be a comma list of distinct integers >= 1 (e.g. 1,2), got {text!r}")
    return values


def apply_isa(isa: str) -> None:
    """Force Tritium's kernels (this process and the tritonserver it starts) onto `isa`'s path."""
    from tritium.client.bench.llamacpp import check_isa
    if check_isa(isa) == "native":
        return
    from tritium.kernels import cpu_isa, cpu_native
    can = cpu_isa.runnable()
    if isa not in can:
        raise ValueError(f"--isa {isa}: this CPU cannot run it; allowed here: native, {', '.join(can)}")
    os.environ[cpu_isa.ENV] = isa
    cpu_native.reset()


def host_section(engines: dict, threads: int, bandwidth_mb: int) -> dict:
    """host_info.host_report plus, per engine, its weight bytes and single-stream decode limit."""
    from tritium.client.bench import host_info
    host = host_info.host_report(threads, bandwidth_mb)
    if "memory" in host:
        host["engines"] = {}
        for kind, path in engines.items():
            nbytes = host_info.engine_weight_bytes(path)
            host["engines"][kind] = {"weight_bytes": nbytes, "bandwidth_limit_tok_s":
                                     host_info.bandwidth_limit_tok_s(host["memory"]["read_gbs"], nbytes)}
    return host


def format_host_section(host: dict) -> str:
    from tritium.client.bench.host_info import format_host
    lines = [format_host(host)]
    for kind, e in host.get("engines", {}).items():
        if e["bandwidth_limit_tok_s"]:
            lines.append(f"  {kind}: {e['weight_bytes'] / 1e6:.0f} MB of weights, single-stream limit "
                         f"{e['bandwidth_limit_tok_s']:.0f} tok/s at the measured read bandwidth")
    return "\n".join(lines)


def expected_activation_quant(kind: str) -> str:
    """The activation_quant PAIRS[kind]'s build gives (int8 / int4: W8A8 / W4A8 by default)."""
    from tritium.builder.quant.smoothquant import resolve_activation_quant
    opts = PAIRS[kind][0]
    return resolve_activation_quant(opts.get("activation_quant", "auto"), opts["quantization"])


def builder_fingerprint() -> str:
    """sha256 over the builder package's Python sources (names and bytes): an engine cached by
    another builder (other defaults, layouts or heads) is not the engine this tree would build."""
    import hashlib

    import tritium.builder
    root = os.path.dirname(tritium.builder.__file__)
    h = hashlib.sha256()
    for dirpath, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(dirpath, name)
            h.update(os.path.relpath(path, root).encode())
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()


def engine_key(kind: str, gguf: str) -> dict:
    """What a cached engine was built from: the pair's options, the GGUF (path, size, mtime) and
    the builder's sources. Stored beside the engine as <kind>.key.json."""
    st = os.stat(gguf)
    return {"pair": kind, "options": {k: str(v) for k, v in sorted(PAIRS[kind][0].items())},
            "gguf": os.path.abspath(gguf), "gguf_size": st.st_size, "gguf_mtime_ns": st.st_mtime_ns,
            "builder": builder_fingerprint()}


def _stale_reason(key_path: str, want: dict) -> str:
    if not os.path.isfile(key_path):
        return "no build key (built before keys were kept)"
    with open(key_path, encoding="utf-8") as f:
        have = json.load(f)
    changed = [k for k in want if have.get(k) != want[k]]
    return f"built with another {', '.join(changed)}" if changed else ""


def ensure_engine(kind: str, gguf: str, engines_dir: str, log, cached: bool = True) -> str:
    """engines_dir/kind, built from the GGUF with PAIRS[kind]'s options when missing. In the
    cache (`cached`) an engine is rebuilt unless its key (engine_key: the pair's options, the
    GGUF, the builder's sources) is the current one. In a folder the user named, an engine whose
    activation_quant is not the pair's is refused."""
    out = os.path.join(engines_dir, kind)
    key_path = out + ".key.json"
    if os.path.isfile(os.path.join(out, "engine.json")):
        if cached:
            want = engine_key(kind, gguf) if os.path.isfile(gguf) else {"gguf": os.path.abspath(gguf)}
            reason = _stale_reason(key_path, want)
            if not reason:
                return out
            log(f"{out}: {reason}: rebuilding it")
            import shutil
            shutil.rmtree(out)
        else:
            with open(os.path.join(out, "engine.json"), encoding="utf-8") as f:
                have = json.load(f).get("activation_quant", "none")
            want_aq = expected_activation_quant(kind)
            if have != want_aq:
                raise ValueError(f"--engines-dir: {out} has activation_quant {have}, the {kind} pair compares "
                                 f"activation_quant {want_aq} (pairs: int8 / int4 W8A8 / W4A8, int8-wo / int4-wo "
                                 f"weight-only); rebuild it or name the pair that matches it")
            return out
    from tritium.builder.build import BuildOptions, build_engine
    log(f"building the {kind} engine into {out} ...")
    build_engine(BuildOptions(source=gguf, output=out + ".partial", progress=False, **PAIRS[kind][0]))
    os.replace(out + ".partial", out)
    if cached:
        with open(key_path, "w", encoding="utf-8") as f:
            json.dump(engine_key(kind, gguf), f, indent=1)
    return out


def run(args: argparse.Namespace) -> int:
    from tritium.client.bench.bench_suite import SuiteOptions
    from tritium.client.bench.llamacpp import ensure_llama_cpp, requantize
    from tritium.client.serve.server import cache_dir
    pairs = parse_pairs(args.pairs)
    for flag in ("repeats", "threads"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    if args.bandwidth_mb < 0:
        raise ValueError(f"--bandwidth-mb must be >= 0 (0 skips the measurement), got {args.bandwidth_mb}")
    from tritium.client.bench.bandwidth_probe import check_probe_flags
    check_probe_flags(args)
    apply_isa(args.isa)
    from tritium.client.cli.bench_cli import api_key_of
    from tritium.client.security import API_KEY_ENV, check_key
    check_key(api_key_of(args), f"--api-key / ${API_KEY_ENV}")
    args.llama_threads = parse_threads(args.llama_threads)
    opts = SuiteOptions(WorkloadSpec(args.num_requests, tuple(args.prompt_words), tuple(args.output_len), args.seed),
                        parse_concurrency(args.concurrency), None, args.single_stream, 12, args.single_stream_tokens,
                        args.warmup, progress=not args.no_progress, client_nice=args.client_nice)
    opts.validate()
    out = sys.stderr if args.json else sys.stdout

    def log(msg):
        print(f"tritium compare: {msg}", file=sys.stderr, flush=True)
    if args.gguf is None:
        from tritium.builder.default_model import smollm2_gguf_path
        args.gguf = smollm2_gguf_path()
    if not os.path.isfile(args.gguf):
        raise FileNotFoundError(f"--gguf {args.gguf}: file not found")
    work = os.path.join(cache_dir(), "compare")
    src = ensure_llama_cpp(args.llama_cpp_dir, log=log, isa=args.isa)
    ggufs = {k: requantize(src, args.gguf, PAIRS[k][1], os.path.join(work, "gguf"), args.isa) for k in pairs}
    engines = {k: ensure_engine(k, args.gguf, args.engines_dir or os.path.join(work, "engines"), log,
                                cached=args.engines_dir is None) for k in pairs}
    import torch
    torch.set_num_threads(args.threads)
    host = host_section(engines, args.threads, args.bandwidth_mb)
    print(format_host_section(host), file=out, flush=True)
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    from tritium.client.bench.bandwidth_probe import probe_for_host
    probe = probe_for_host(host) if opts.single_stream else None  # the read beside each single stream
    results = {}
    for p_idx, kind in enumerate(pairs):
        log(f"pair {kind}: llama-server {os.path.basename(ggufs[kind])} vs tritium serve {engines[kind]}")
        results[kind] = run_pair(kind, src, ggufs[kind], engines[kind], opts, args, p_idx, work, probe)
        if probe is not None:
            results[kind].update(weight_bytes=host["engines"][kind]["weight_bytes"],
                                 read_gbs=host["memory"]["read_gbs"])
    report = summary(results, pairs)
    report.update({"started": started, "finished": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                   "llama_cpp_dir": src, "isa": args.isa, "host": host, "gguf": args.gguf, "engines": engines,
                   "threads": args.threads, "triton_protocol": args.triton_protocol,
                   "llama_threads": args.llama_threads,
                   "bandwidth_probe": probe.describe() if probe is not None else None,
                   "workload": results[pairs[0]]["reps"][0]["workload"]})
    print(format_host_section(host) + "\n" + format_table(report) + f"\ntritium serve read over {args.triton_protocol} "
          f"({'generate_stream SSE' if args.triton_protocol == 'http' else 'tritonclient gRPC stream'})",
          file=out, flush=True)
    if args.json:
        print(json.dumps(report, sort_keys=True))
    return 0


def run_pair(kind, src, gguf, engine, opts, args, p_idx, work, probe=None) -> dict:
    """Both servers (and the in-process engine) up for one pair; the suite `--repeats` times."""
    import dataclasses

    from tritium.builder.repository import write_repository
    from tritium.client.bench.bench_drivers import InProcessDriver
    from tritium.client.bench.bench_triton_http import make_triton_driver
    from tritium.client.bench.bench_openai import OpenAIDriver
    from tritium.client.bench.bench_suite import run_suite
    from tritium.client.bench.llamacpp import LlamaServer
    from tritium.client.serve.proc_cpu import group_cpu_seconds
    from tritium.client.cli.bench_cli import api_key_of
    from tritium.client.security import Security
    from tritium.client.serve.server import TritonServer
    logs = os.path.join(work, "logs")
    os.makedirs(logs, exist_ok=True)
    repo = os.path.join(work, "repos", kind)
    write_repository(repo, MODEL, os.path.abspath(engine))
    parallel = max(16, max(opts.concurrencies))
    many = len(args.llama_threads) > 1
    key = api_key_of(args)
    llamas = {(f"llama-server-t{t}" if many else "llama-server"):
              LlamaServer(src, gguf, parallel=parallel, threads=t, extra_args=shlex.split(args.llama_server_args),
                          log_file=os.path.join(logs, f"llama-server-{kind}-t{t}.log"), isa=args.isa, api_key=key)
              for t in args.llama_threads}
    triton = TritonServer(repo, log_file=os.path.join(logs, f"tritonserver-{kind}.log"), load_models=[MODEL],
                          security=Security(api_key=key))
    inproc, targets = None, {}
    try:
        for llama in llamas.values():
            llama.start()
        triton.start(timeout=600)
        targets = {name: OpenAIDriver(llama.url, api_key=key) for name, llama in llamas.items()}
        # http: tritonserver's own HTTP port (as gRPC, no proxy between the client and the server)
        url = triton.triton_http_url if args.triton_protocol == "http" else triton.grpc_url
        targets["tritium-serve"] = make_triton_driver(args.triton_protocol, url, MODEL, api_key=key)
        if not args.no_in_process:
            targets["in-process"] = inproc = InProcessDriver(engine)
        for d in targets.values():
            d.check()
        pgids = {name: llama.proc.pid for name, llama in llamas.items()}
        pgids["tritium-serve"] = triton.proc.pid
        if probe is not None:  # each probe waits for both servers and this process to go quiet
            from tritium.client.bench.bandwidth_probe import watch_probe
            watch_probe(probe, args, pgids)
        idle0 = {n: group_cpu_seconds(g) for n, g in pgids.items()}
        time.sleep(5.0)
        idle = {n: (group_cpu_seconds(g) - idle0[n]) / 5.0 for n, g in pgids.items()}
        reps, load = [], [os.getloadavg()[0]]
        for rep in range(args.repeats):
            o = dataclasses.replace(opts, tag=f"r{rep}")
            result, raw = run_suite(targets, o, order_offset=p_idx + rep, probe=probe)
            if args.plot:
                from tritium.client.bench.bench_plots import write_plots
                result["plots"] = write_plots(os.path.join(args.plot, f"{kind}-r{rep}"), raw)
            reps.append(result)
        load.append(os.getloadavg()[0])  # the host's 1-minute load before and after: how busy it was
        return {"reps": reps, "idle_server_cores": idle, "host_load": load,
                "llama_server_cmd": [" ".join(x.cmd[1:]) for x in llamas.values()]}
    finally:
        for d in targets.values():  # the Triton driver's stream, the in-process engine
            d.close()
        triton.stop()
        for llama in llamas.values():
            llama.stop()
