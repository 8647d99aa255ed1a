"""`tritium serve [--repo DIR] [--http-port N] [--grpc-port N] [--metrics-port N] [--openai-port N]`.

Starts the real tritonserver (nvidia-pytriton wheel) with the `tritium` backend installed
beside the python backend, waits until every model is ready, prints the endpoints, and stops
cleanly (no child left) on Ctrl-C, SIGINT or SIGTERM. Beside it, in this process, the
OpenAI-compatible API (client/openai/openai_server.py) listens on --openai-port. With no --repo it builds the default
SmolLM2-135M-Instruct engine once into the Tritium cache, writes a repository next to it and
serves that.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import threading

from tritium.client.serve.launch_checks import default_log_file
from tritium.client.sockets import check_ports_free

DEFAULT_NAME = "smollm2"
# bf16 by default: on CPU the int8 / int4 engines decode one stream faster but serve batches no
# faster than bf16 (docs/benchmarks.md), and a server runs batches. Serve a quantized engine with
# `tritium build ... --quantization int4-gptq --repo DIR --name NAME` + `tritium serve --repo DIR`.
DEFAULT_DTYPE = "bfloat16"
DEFAULT_QUANTIZATION = "none"
# The question of the printed hints: SmolLM2-135M-Instruct answers it correctly (docs/openai.md).
HINT_QUESTION = "What is the capital of France?"


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve a model repository from a real tritonserver",
                       description="Start tritonserver with the tritium backend. Without --repo, build (once, "
                                   "cached) and serve SmolLM2-135M-Instruct.")
    p.add_argument("--repo", default=None, help="model repository (from `tritium build --repo`); "
                                                "default: the cached SmolLM2 repository")
    p.add_argument("--http-port", type=int, default=8000, help="HTTP port (default 8000; 0 = any free port)")
    p.add_argument("--grpc-port", type=int, default=8001, help="gRPC port (default 8001; 0 = any free port)")
    p.add_argument("--metrics-port", type=int, default=8002, help="metrics port (default 8002; 0 = any free)")
    p.add_argument("--openai-port", type=int, default=9000,
                   help="port of the OpenAI-compatible API (/v1/chat/completions, /v1/completions, /v1/models) "
                        "served beside tritonserver (default 9000; 0 = any free port; -1 = off)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--log-file", default=None,
                   help="write the server log here (default: <cache>/logs/tritonserver-<HTTP port>.log, "
                        "one per server)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for readiness (default 600)")
    p.add_argument("--max-decode-burst", type=int, default=None, metavar="N",
                   help="greedy decode steps one native call may run (sets TRITIUM_DECODE_BURST for the server, "
                        "over the models' max_decode_burst parameter; 1: off; docs/serving.md#decode-bursts)")
    from tritium.client.serve.http_checks import GuardLimits
    p.add_argument("--max-body-bytes", type=int, default=GuardLimits.max_body_bytes,
                   help="HTTP guard: largest request body, after gzip/deflate (default %(default)s)")
    p.add_argument("--max-json-depth", type=int, default=GuardLimits.max_json_depth,
                   help="HTTP guard: deepest JSON nesting of a request (default %(default)s)")
    from tritium.client.security import add_arguments as add_security_arguments
    add_security_arguments(p)  # --api-key --admin-key --tls-cert --tls-key --insecure (docs/security.md)
    p.set_defaults(func=run)


def default_repository() -> str:
    """Build SmolLM2's engine into the cache if needed, write its repository; return the repo path."""
    from tritium.builder.repository import write_repository
    from tritium.client.serve.server import cache_dir
    engine = default_engine_dir()
    if not os.path.isfile(os.path.join(engine, "engine.json")):
        from tritium.builder.build import BuildOptions, build_engine
        from tritium.builder.default_model import smollm2_gguf_path
        print(f"tritium serve: building the default engine into {engine} (once) ...", file=sys.stderr)
        tmp = engine + ".partial"
        build_engine(BuildOptions(source=smollm2_gguf_path(), output=tmp, dtype=DEFAULT_DTYPE,
                                  quantization=DEFAULT_QUANTIZATION, progress=True))
        if os.path.isdir(engine):  # an incomplete engine (no engine.json) from an older run
            shutil.rmtree(engine)
        os.replace(tmp, engine)  # a killed build never leaves a half engine behind
    repo = os.path.join(cache_dir(), "repos", DEFAULT_NAME)
    write_repository(repo, DEFAULT_NAME, engine)
    return repo


def default_engine_dir() -> str:
    from tritium.client.serve.server import cache_dir
    return os.path.join(cache_dir(), "engines", f"{DEFAULT_NAME}-135m-instruct")


def _port(v: int):
    if v < 0 or v > 65535:
        raise ValueError(f"port must be in [0, 65535], got {v}")
    return v or None  # 0 -> pick a free port


def repository_models(repo: str) -> list:
    """Model names in a repository folder (NAME/config.pbtxt); ValueError if there are none."""
    if not os.path.isdir(repo):
        raise ValueError(f"--repo {repo}: not a folder")
    models = sorted(n for n in os.listdir(repo) if os.path.isfile(os.path.join(repo, n, "config.pbtxt")))
    if not models:
        raise ValueError(f"--repo {repo}: holds no model (no NAME/config.pbtxt); write one with "
                         f"`tritium build SOURCE -o ENGINE_DIR --repo {repo} --name NAME`")
    return models


def _limits(args):
    from tritium.client.serve.http_checks import GuardLimits
    for name in ("max_body_bytes", "max_json_depth"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return GuardLimits(max_body_bytes=args.max_body_bytes, max_json_depth=args.max_json_depth)


def _security(args):
    """The keys and TLS files; a non-loopback --host with no API key is refused (exit 2) unless --insecure."""
    from tritium.client.security import check_exposure, security_from_args
    sec = security_from_args(args)
    openai = f", {args.openai_port} (OpenAI API)" if args.openai_port != -1 else ""
    what = (f"inference on ports {args.http_port} (HTTP), {args.grpc_port} (gRPC){openai} "
            f"and metrics on {args.metrics_port}")
    check_exposure(args.host, sec, args.insecure, what)
    return sec


def _openai_server(args, security):
    """The OpenAI API's server with its port bound now (a taken port fails before tritonserver starts)."""
    if args.openai_port == -1:
        return None
    try:
        from tritium.client.openai.openai_server import OpenAIServer
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise OSError("the OpenAI API needs fastapi and uvicorn: pip install 'tritium[serve]' "
                      "(or --openai-port -1 to serve without it)") from None
    # tritonserver's gRPC serves the same certificate: the API trusts that file to reach it
    return OpenAIServer("", host=args.host, port=args.openai_port, security=security, triton_tls_ca=security.tls_cert)


def run(args: argparse.Namespace) -> int:
    limits = _limits(args)
    if getattr(args, "max_decode_burst", None) is not None:  # the server (a child) inherits the environment
        from tritium.backend.decode_burst import ENV, check_max_burst
        os.environ[ENV] = str(check_max_burst(args.max_decode_burst, "--max-decode-burst"))
    ports = dict(http_port=_port(args.http_port), grpc_port=_port(args.grpc_port),
                 metrics_port=_port(args.metrics_port))
    if args.openai_port < -1 or args.openai_port > 65535:
        raise ValueError(f"--openai-port must be in [0, 65535], or -1 for off; got {args.openai_port}")
    security = _security(args)
    # Every port at once, before anything is built, started or written (a log file included).
    check_ports_free(args.host, _public_ports(args))
    if args.repo:
        repository_models(args.repo)  # before anything starts
    openai = _openai_server(args, security)
    try:
        return _serve(args, ports, limits, openai, security)
    finally:
        if openai is not None:
            openai.stop()


def _public_ports(args) -> list:
    return [("HTTP", args.http_port), ("gRPC", args.grpc_port), ("metrics", args.metrics_port)] + \
        ([("OpenAI", args.openai_port)] if args.openai_port > 0 else [])


def _serve(args, ports, limits, openai, security) -> int:
    from tritium.client.serve.server import TritonServer, cache_dir, free_port
    repo = args.repo if args.repo else default_repository()
    ports["http_port"] = ports["http_port"] or free_port(args.host)  # the log's name needs it now
    log_file = args.log_file or default_log_file(cache_dir(), ports["http_port"])
    srv = TritonServer(repo, host=args.host, log_file=log_file, guard_limits=limits, security=security, **ports)
    check_ports_free(args.host, srv.ports())  # again (a first build takes minutes), then start a fresh log
    open(log_file, "w").close()
    stop = threading.Event()

    def on_signal(signum, frame):
        stop.set()
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        print(f"tritium serve: starting tritonserver on {repo} (log: {log_file}) ...", file=sys.stderr)
        srv.start(wait=False)
        ready = threading.Thread(target=lambda: _wait(srv, args.timeout, stop), daemon=True)
        ready.start()
        while ready.is_alive() and not stop.is_set():
            ready.join(0.2)
        if stop.is_set() and not srv.is_ready():
            return 130
        if srv.proc.poll() is not None or not srv.is_ready():
            raise RuntimeError(getattr(srv, "_ready_error", "tritonserver did not become ready"))
        models = ready_models(srv)
        if not models:
            raise RuntimeError(f"tritonserver is up but serves no model (log: {log_file})")
        print(f"tritonserver ready: HTTP {srv.scheme}://{srv.http_url}  gRPC {srv.grpc_url}  metrics {srv.metrics_url}")
        print(f"models: {', '.join(models)}")
        llm = next((m for m in models if not m.endswith(("_preprocessing", "_postprocessing", "_ensemble", "_bls"))),
                   models[0])
        if openai is not None:
            openai.triton_url = srv.grpc_url
            openai.start()
            print(f"OpenAI API: {openai.url}")
            body = json.dumps({"model": llm, "messages": [{"role": "user", "content": HINT_QUESTION}],
                               "max_tokens": 48, "temperature": 0})
            auth = " -H \"Authorization: Bearer $TRITIUM_API_KEY\"" if security.api_key else ""
            tls = f" --cacert {security.tls_cert}" if security.tls else ""
            print(f"try: curl -s{tls} {openai.url}/chat/completions{auth} -H 'Content-Type: application/json' "
                  f"-d '{body}'")
        tls = f" --tls-ca {security.tls_cert}" if security.tls else ""  # the key: from $TRITIUM_API_KEY
        print(f'try: tritium generate --url {srv.grpc_url}{tls} --model {llm} --chat --stream "{HINT_QUESTION}"')
        print("Ctrl-C stops the server.", flush=True)
        while not stop.is_set():
            if srv.proc.poll() is not None:
                print(f"tritium serve: tritonserver exited with code {srv.proc.returncode} (log: {log_file})",
                      file=sys.stderr)
                return 1
            stop.wait(0.5)
        print("tritium serve: stopping ...", file=sys.stderr)
        return 0
    except RuntimeError as e:
        raise OSError(str(e)) from None
    finally:
        if openai is not None:
            openai.stop()  # first: its open requests end as cancelled, not as errors
        srv.stop()
        for s, h in old.items():
            signal.signal(s, h)


def ready_models(srv) -> list:
    """Names of the models this server reports READY (its repository index, through our own guard,
    with the admin key only this process holds unless --admin-key was given)."""
    import json
    with srv.urlopen("/v2/repository/index", data=b"{}", admin=True) as r:
        index = json.loads(r.read())
    return sorted({m["name"] for m in index if m.get("state") == "READY"})


def _wait(srv, timeout: float, stop: threading.Event) -> None:
    try:
        srv.wait_ready(timeout)
    except (RuntimeError, TimeoutError) as e:
        srv._ready_error = str(e)
