"""`tritium` console command: a thin dispatcher over subcommand modules.

Each module in SUBCOMMANDS exposes `register(subparsers)`, which adds its parser and sets
`func=<callable(args) -> int>` as the parser default. User errors (ValueError, OSError and the
engine/format errors derived from them, and tritonclient's errors from a server) print one line
and exit 2; anything else is a bug and prints one line too, exit 1 (TRITIUM_DEBUG=1 re-raises it
with its traceback).
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys


SUBCOMMANDS = [
    "tritium.client.cli.build_cli",          # build
    "tritium.client.cli.generate_cli",  # generate (in-process or --url)
    "tritium.client.cli.eval_cli",      # eval (perplexity, KL / top-1 vs a reference engine)
    "tritium.client.cli.serve_cli",     # serve (real tritonserver, + the OpenAI-compatible API)
    "tritium.client.cli.openai_cli",    # openai (the OpenAI-compatible API alone, in front of a tritonserver)
    "tritium.client.bench.openai_bench",  # bench-openai (NVIDIA aiperf against the OpenAI API)
    "tritium.client.bench.kernel_bench",        # bench-kernels (Triton kernels on a CUDA GPU)
    "tritium.client.cli.bench_cli",     # bench (serving benchmark; --hf-baselines: engine vs HF transformers)
    "tritium.client.cli.compare_cli",   # compare (side by side with llama.cpp's llama-server)
    "tritium.client.cli.gpu_check_cli",  # gpu-check (the CUDA path in one run; CPU parts without CUDA)
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
    from tritium.client import grpc_setup
    grpc_setup.apply()  # before any subcommand imports grpc (client/grpc_setup.py)
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
    except Exception as e:
        if os.environ.get("TRITIUM_DEBUG"):
            raise
        if type(e).__name__ == "InferenceServerException":  # tritonclient: the server said no
            print(f"tritium {args.command}: error: {_one_line(str(e))}", file=sys.stderr)
            return 2
        print(f"tritium {args.command}: internal error: {type(e).__name__}: {_one_line(str(e))} "
              f"(TRITIUM_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 1
    return int(rc or 0)


def _one_line(msg: str) -> str:
    return " ".join(msg.split())


if __name__ == "__main__":
    sys.exit(main())
