"""`tritium openai --triton-url HOST:PORT [--host H] [--port N]`: the OpenAI-compatible API alone.

Serves /v1/models, /v1/completions and /v1/chat/completions (client/openai/openai_server.py) in front of
any tritonserver that serves the Tritium tensor contract, reached over gRPC at --triton-url
(`tritium serve` prints it; `tritium serve` also starts this API itself on --openai-port).
"""
from __future__ import annotations

import argparse
import signal
import sys

DEFAULT_PORT = 9000


def register(sub) -> None:
    p = sub.add_parser("openai", help="serve the OpenAI-compatible API in front of a running tritonserver",
                       description="OpenAI-compatible HTTP API (/v1/models, /v1/completions, /v1/chat/completions) "
                                   "that forwards every request to tritonserver over gRPC streaming.")
    p.add_argument("--triton-url", required=True, help="tritonserver's gRPC HOST:PORT (e.g. 127.0.0.1:8001)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0 = any free port)")
    p.add_argument("--max-body-bytes", type=int, default=16 << 20,
                   help="largest request body in bytes (default %(default)s; larger ones get 413)")
    p.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's log level (default warning)")
    p.add_argument("--tool-call-parser", default="auto", choices=("auto", "hermes", "llama3", "mistral"),
                   help="how the model writes tool calls (default auto: from the model's chat template, "
                        "hermes when it cannot tell)")
    p.add_argument("--triton-tls-ca", default=None,
                   help="reach tritonserver's gRPC over TLS, trusting this PEM certificate")
    from tritium.client.security import add_arguments as add_security_arguments
    # --api-key: this API's key, also sent to tritonserver; --admin-key: tritonserver's admin key,
    # needed to list its models (its model-repository and model-config APIs are restricted)
    add_security_arguments(p)
    p.set_defaults(func=run)


def check_port(value: int, flag: str) -> int:
    if value < 0 or value > 65535:
        raise ValueError(f"{flag} must be in [0, 65535], got {value}")
    return value


def run(args: argparse.Namespace) -> int:
    from tritium.client.openai.openai_server import OpenAIServer
    from tritium.client.security import check_exposure, security_from_args
    check_port(args.port, "--port")
    security = security_from_args(args)
    check_exposure(args.host, security, args.insecure, f"the OpenAI API (port {args.port})")
    if args.max_body_bytes < 1:
        raise ValueError(f"--max-body-bytes must be >= 1, got {args.max_body_bytes}")
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise OSError("the OpenAI API needs fastapi and uvicorn: pip install 'tritium[serve]'") from None
    srv = OpenAIServer(args.triton_url, host=args.host, port=args.port, max_body_bytes=args.max_body_bytes,
                       log_level=args.log_level, security=security, triton_tls_ca=args.triton_tls_ca,
                       tool_call_parser=args.tool_call_parser)
    print(f"OpenAI API: {srv.url}  (tritonserver gRPC {args.triton_url}); Ctrl-C stops it.", flush=True)
    print(f"try: curl {srv.url}/models", file=sys.stderr, flush=True)
    # uvicorn stops on SIGINT / SIGTERM, then re-raises the signal to the handlers it found: make
    # those no-ops, so that a stop by signal is a clean exit (0), as for `tritium serve`.
    old = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        srv.run()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return 0
