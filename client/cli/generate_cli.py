"""`tritium generate`: print a completion from an engine run in this process (--engine) or from a
running tritonserver (--url)."""
from __future__ import annotations

import argparse


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate text: in-process from an engine (--engine) or from a running "
                                        "tritonserver (--url)",
                       description="Generate a completion. With --engine the engine runs in this process (no "
                                   "server); with --url a running tritonserver answers over gRPC or HTTP.")
    p.add_argument("prompt", nargs="?", default=None, help="prompt text")
    p.add_argument("--engine", help="engine directory (from `tritium build`)")
    p.add_argument("--prompt-ids", default=None, help="comma-separated token ids; replaces the text prompt")
    p.add_argument("--chat", action="store_true",
                   help="PROMPT (and each --input-file prompt) is a user message: the engine's chat template "
                        "turns it into the prompt (with --url: the server's engine's template)")
    p.add_argument("--system", default=None, metavar="TEXT", help="with --chat: a system message before it")
    p.add_argument("--json", action="store_true",
                   help='print one JSON object per line: {"text","token_ids","prompt_token_ids","finish_reason"}')
    from tritium.client.cli.generate_inputs import add_field_arguments
    add_field_arguments(p)  # --max-tokens/--temperature/--stop/...: one flag per request field
    from tritium.client.cli.generate_inputs import add_guide_arguments
    add_guide_arguments(p)  # --json-schema/--regex/--choice/--grammar
    from tritium.client.cli.remote_generate import add_remote_arguments
    add_remote_arguments(p)  # --url/--model/--stream/--protocol: see remote_generate.py
    from tritium.client.cli.engine_generate import add_engine_arguments
    add_engine_arguments(p)  # --input-file/--stats/--speculative/...: see engine_generate.py
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.system is not None and not args.chat:
        raise ValueError("--system needs --chat")
    if args.chat and args.prompt_ids:
        raise ValueError("--chat takes a text PROMPT (a user message), not --prompt-ids")
    if getattr(args, "url", None):
        if getattr(args, "lora", None) or getattr(args, "max_lora_rank", None) is not None:
            raise ValueError("--lora / --max-lora-rank load adapters in-process (--engine); with --url pick "
                             "one the server serves with --lora-name")
        from tritium.client.cli.remote_generate import run_remote
        return run_remote(args)
    if not args.engine:
        raise ValueError("--engine ENGINE_DIR is required")
    # In-process: the in-flight LLMEngine; see client/cli/engine_generate.py.
    from tritium.client.cli.engine_generate import run_engine
    return run_engine(args)
