"""`tritium generate`: run an engine in-process and print the completion."""
from __future__ import annotations

import argparse
import json
import sys


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate text from an engine (in-process, no server)",
                       description="Generate a completion. With --engine the engine runs in this process.")
    p.add_argument("prompt", nargs="?", default=None, help="prompt text")
    p.add_argument("--engine", help="engine directory (from `tritium build`)")
    p.add_argument("--prompt-ids", default=None, help="comma-separated token ids; replaces the text prompt")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default 0)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--json", action="store_true",
                   help='print one JSON object per line: {"text","token_ids","prompt_token_ids","finish_reason"}')
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    from tritium.client.remote_generate import add_remote_arguments
    add_remote_arguments(p)  # --url/--model/--stream/--protocol: see remote_generate.py
    p.set_defaults(func=run)


def parse_prompt_ids(s: str):
    try:
        ids = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--prompt-ids must be comma-separated integers, got {s!r}") from None
    if not ids:
        raise ValueError("--prompt-ids is empty")
    return ids


def run(args: argparse.Namespace) -> int:
    if getattr(args, "url", None):
        from tritium.client.remote_generate import run_remote
        return run_remote(args)
    from tritium.backend.loader import load_engine
    from tritium.backend.simple_generate import generate_simple
    if not args.engine:
        raise ValueError("--engine ENGINE_DIR is required")
    if args.prompt is None and args.prompt_ids is None:
        raise ValueError("give a PROMPT or --prompt-ids")
    if args.temperature < 0 or args.temperature != args.temperature:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {args.top_p}")
    cfg, model, tok = load_engine(args.engine, args.device)
    if args.prompt_ids is not None:
        prompt_ids = parse_prompt_ids(args.prompt_ids)
    else:
        if tok is None:
            raise ValueError(f"{args.engine}: engine has no tokenizer.json; use --prompt-ids")
        prompt_ids = tok.encode(args.prompt).ids
    if not prompt_ids:
        raise ValueError("prompt is empty")
    bad = [i for i in prompt_ids if not 0 <= i < cfg.model.vocab_size]
    if bad:
        raise ValueError(f"prompt token id {bad[0]} outside [0, {cfg.model.vocab_size})")
    if args.max_tokens < 1 or len(prompt_ids) + args.max_tokens > cfg.limits.max_seq_len:
        raise ValueError(f"--max-tokens must be in [1, {cfg.limits.max_seq_len - len(prompt_ids)}] "
                         f"(max_seq_len {cfg.limits.max_seq_len} minus {len(prompt_ids)} prompt tokens)")
    ids, reason = generate_simple(model, prompt_ids, args.max_tokens, args.temperature, args.top_k,
                                  args.top_p, args.seed, cfg.model.eos_token_ids)
    text = tok.decode(ids, skip_special_tokens=True) if tok is not None else ""
    if args.json:
        print(json.dumps({"text": text, "token_ids": ids, "prompt_token_ids": prompt_ids,
                          "finish_reason": reason}, ensure_ascii=False))
    else:
        sys.stdout.write(text + "\n")
    return 0
