"""`tritium` console command: a thin dispatcher over subcommand modules.

Each module in SUBCOMMANDS exposes `register(subparsers)`, which adds its parser and sets
`func=<callable(args) -> int>` as the parser default. User errors (ValueError, OSError and the
engine/format errors derived from them) print one line and exit 2; no tracebacks.
"""
from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = [
    "tritium.builder.cli",          # build
    "tritium.client.generate_cli",  # generate (in-process or --url)
    "tritium.client.eval_cli",      # eval (perplexity, KL / top-1 vs a reference engine)
    "tritium.client.serve_cli",     # serve (real tritonserver)
    "tritium.kernels.bench",        # bench-kernels (Triton kernels on a CUDA GPU)
    "tritium.client.bench_cli",     # bench (serving benchmark; --hf-baselines: engine vs HF transformers)
    "tritium.client.compare_cli",   # compare (side by side with llama.cpp's llama-server)
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tritium", description="Build, run and serve LLM engines on NVIDIA Triton Inference Server.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for mod in SUBCOMMANDS:
        importlib.import_module(mod).register(sub)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        rc = args.func(args)
    except KeyboardInterrupt:
        print("tritium: interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError, KeyError) as e:
        msg = str(e) if not isinstance(e, KeyError) else f"missing key {e}"
        print(f"tritium {args.command}: error: {msg}", file=sys.stderr)
        return 2
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
