"""`tritium eval --engine DIR [--text FILE] [--num-tokens N] [--reference ENGINE_DIR] [--json] [--add-bos]`

Perplexity of an engine over the first N tokens of a text (default: the builder's evaluation
text, docstrings of standard-library modules that the calibration text does not use). With a
reference engine (e.g. the float engine a quantized one came from) it also reports the mean
KL(reference || engine) of next-token distributions and their top-1 agreement.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

DEFAULT_NUM_TOKENS = 2048


def register(sub) -> None:
    p = sub.add_parser("eval", help="perplexity of an engine (and KL / top-1 vs a reference engine)",
                       description="Perplexity over the first N tokens of a text, in consecutive windows of "
                                   "at most the engine's max_seq_len; no special tokens unless --add-bos.")
    p.add_argument("--engine", required=True, help="engine directory")
    p.add_argument("--text", default=None,
                   help="UTF-8 text file (default: the built-in evaluation text, Python stdlib docstrings)")
    p.add_argument("--num-tokens", type=int, default=DEFAULT_NUM_TOKENS,
                   help=f"tokens of the text to score (default {DEFAULT_NUM_TOKENS})")
    p.add_argument("--reference", default=None, help="reference engine directory (same tokenizer)")
    p.add_argument("--add-bos", action="store_true", help="prepend the BOS token")
    p.add_argument("--json", action="store_true", help='print {"perplexity", "tokens", ...} as JSON')
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.num_tokens < 2:
        raise ValueError(f"--num-tokens must be >= 2, got {args.num_tokens}")
    if args.text is not None and not os.path.isfile(args.text):
        raise ValueError(f"--text {args.text}: file not found")
    from tritium.backend.loader import load_engine
    from tritium.builder.calibration import default_eval_text
    from tritium.builder.quant_eval import encode_text, evaluate

    cfg, model, tokenizer = load_engine(args.engine, args.device)
    if tokenizer is None:
        raise ValueError(f"--engine {args.engine}: engine has no tokenizer.json")
    reference = None
    if args.reference:
        rcfg, reference, _ = load_engine(args.reference, args.device)
        if rcfg.model.vocab_size != cfg.model.vocab_size:
            raise ValueError(f"--reference {args.reference}: vocabulary size {rcfg.model.vocab_size} differs "
                             f"from the engine's {cfg.model.vocab_size}")
    if args.text is not None:
        with open(args.text, encoding="utf-8", errors="replace") as f:
            text = f.read()
    else:
        text = default_eval_text()
    ids = encode_text(tokenizer, text, args.num_tokens, args.add_bos, cfg.model.bos_token_id)
    res = evaluate(model, ids, reference=reference, progress=not args.json)
    res.update(engine=args.engine, text=args.text or "default (python stdlib docstrings)",
               quantization=cfg.quantization.method, kv_cache_dtype=cfg.kv_cache.dtype)
    if args.reference:
        res["reference"] = args.reference
    if args.json:
        print(json.dumps(res, sort_keys=True))
        return 0
    print(f"perplexity {res['perplexity']:.4f} over {res['tokens']} tokens ({res['windows']} window(s))")
    if reference is not None:
        print(f"reference perplexity {res['reference_perplexity']:.4f} "
              f"({100 * res['perplexity_increase']:+.2f}%), mean KL {res['mean_kl']:.5f}, "
              f"top-1 agreement {100 * res['top1_agreement']:.2f}%")
    sys.stdout.flush()
    return 0
