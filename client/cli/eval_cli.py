"""`tritium eval --engine DIR [--text FILE | --domain NAME] [--num-tokens N] [--reference ENGINE_DIR] [--json] [--add-bos]`

Perplexity of an engine over the first N tokens of a text: a file, or one of the builder's
shipped domains (default `kjv`, held-out prose that no calibration set contains; see
builder/calibration_mix.py). With a reference engine (e.g. the float engine a quantized one came
from) it also reports the mean KL(reference || engine) of next-token distributions and their
top-1 agreement.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from tritium.builder.calibration_mix import EVAL_DOMAINS, HELD_OUT_DOMAINS

DEFAULT_NUM_TOKENS = 2048
DEFAULT_DOMAIN = "kjv"


def register(sub) -> None:
    p = sub.add_parser("eval", help="perplexity of an engine (and KL / top-1 vs a reference engine)",
                       description="Perplexity over the first N tokens of a text, in consecutive windows of "
                                   "at most the engine's max_seq_len; no special tokens unless --add-bos.")
    p.add_argument("--engine", required=True, help="engine directory")
    p.add_argument("--text", default=None, help="UTF-8 text file to score (instead of --domain)")
    p.add_argument("--domain", default=None, metavar="NAME",
                   help=f"a shipped text: {', '.join(EVAL_DOMAINS)} (default {DEFAULT_DOMAIN}; held out from "
                        f"calibration: {', '.join(HELD_OUT_DOMAINS)}; dialogue is rendered in the engine's chat format)")
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
    if args.text is not None and args.domain is not None:
        raise ValueError("--text and --domain are alternatives: give one of them")
    if args.text is not None and not os.path.isfile(args.text):
        raise ValueError(f"--text {args.text}: file not found")
    domain = args.domain or (DEFAULT_DOMAIN if args.text is None else None)
    if domain is not None and domain not in EVAL_DOMAINS:
        raise ValueError(f"--domain {domain!r} is not a shipped domain; allowed: {', '.join(EVAL_DOMAINS)}")
    from tritium.backend.chat_template import ChatTemplate, read_template_source
    from tritium.backend.loader import load_engine
    from tritium.builder.calibration_mix import domain_text
    from tritium.builder.quant.quant_eval import encode_text, evaluate

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
        template = (ChatTemplate.from_engine_dir(args.engine)
                    if domain == "dialogue" and read_template_source(args.engine) is not None else None)
        text = domain_text(domain, template)
    ids = encode_text(tokenizer, text, args.num_tokens, args.add_bos, cfg.model.bos_token_id)
    res = evaluate(model, ids, reference=reference, progress=not args.json)
    res.update(engine=args.engine, text=args.text or f"domain:{domain}",
               quantization=cfg.quantization.method, kv_cache_dtype=cfg.kv_cache.dtype)
    res["weight_bytes"] = _weight_bytes(args.engine, cfg)
    if args.reference:
        res["reference"] = args.reference
        res["reference_weight_bytes"] = _weight_bytes(args.reference, rcfg)
        res["bytes_vs_reference"] = res["weight_bytes"] / max(res["reference_weight_bytes"], 1)
    if args.json:
        print(json.dumps(res, sort_keys=True))
        return 0
    print(f"perplexity {res['perplexity']:.4f} over {res['tokens']} tokens ({res['windows']} window(s))")
    if reference is not None:
        print(f"reference perplexity {res['reference_perplexity']:.4f} "
              f"({100 * res['perplexity_increase']:+.2f}%), mean KL {res['mean_kl']:.5f}, "
              f"top-1 agreement {100 * res['top1_agreement']:.2f}%")
        print(f"weights {res['weight_bytes'] / 1e6:.1f} MB, {res['bytes_vs_reference']:.3f}x the reference's "
              f"{res['reference_weight_bytes'] / 1e6:.1f} MB")
    sys.stdout.flush()
    return 0


def _weight_bytes(engine_dir: str, cfg) -> int:
    """Bytes of an engine's weight files (every rank's rank{r}.safetensors)."""
    return sum(os.path.getsize(os.path.join(engine_dir, cfg.weights_file(r)))
               for r in range(cfg.tensor_parallel_size))
