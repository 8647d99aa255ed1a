"""`tritium generate --url HOST:PORT "PROMPT" [--model NAME] [--stream] [--protocol grpc|http]`.

The remote form of `tritium generate`: the same sampling flags and --json output, sent to a
Tritium model on a running tritonserver through tritonclient (gRPC streaming) or Triton's
HTTP generate / generate_stream endpoints. generate_cli.py calls run_remote() when --url is
given.
"""
from __future__ import annotations

import argparse
import json
import sys

DEFAULT_MODEL = "smollm2"


def add_remote_arguments(p: argparse.ArgumentParser) -> None:
    """The --url / --model / --stream / --protocol flags of `tritium generate`."""
    g = p.add_argument_group("remote (a running tritonserver, e.g. from `tritium serve`)")
    g.add_argument("--url", default=None,
                   help="HOST:PORT of tritonserver (gRPC port for --protocol grpc, HTTP port for http)")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"model name on the server: NAME, NAME_ensemble or NAME_bls (default {DEFAULT_MODEL})")
    g.add_argument("--stream", action="store_true", help="print text as it is generated")
    g.add_argument("--protocol", default="grpc", choices=("grpc", "http"),
                   help="grpc (tritonclient streaming) or http (generate / generate_stream); default grpc")


def request_params(args: argparse.Namespace) -> dict:
    """Map the CLI's sampling flags onto the tensor contract's input names."""
    params = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    for flag, name in (("top_k", "top_k"), ("top_p", "top_p"), ("seed", "seed"), ("n", "num_return_sequences")):
        v = getattr(args, flag, None)
        if v is not None:
            params[name] = v
    stops = getattr(args, "stop", None)
    if stops:
        params["stop_words"] = list(stops)
    if getattr(args, "logprobs", None) is not None:
        params["return_log_probs"] = True
    prompt_ids = getattr(args, "prompt_ids", None)
    if prompt_ids:
        from tritium.client.generate_cli import parse_prompt_ids
        params["input_ids"] = parse_prompt_ids(prompt_ids)
    return params


def run_remote(args: argparse.Namespace) -> int:
    """Send one request; print text (streamed live with --stream) or JSON lines with --json."""
    from tritium.client.triton_client import TritiumClient, TritiumClientError
    if args.prompt is None and not getattr(args, "prompt_ids", None):
        raise ValueError("give a PROMPT or --prompt-ids")
    client = TritiumClient(args.url, protocol=args.protocol, model=args.model)
    params = request_params(args)
    try:
        if args.stream:
            chunks = []
            for c in client.stream(args.prompt, **params):
                chunks.append(c)
                if args.json:
                    print(json.dumps({"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
                                      "index": c.sequence_index}, ensure_ascii=False), flush=True)
                else:
                    sys.stdout.write(c.text)
                    sys.stdout.flush()
            if not args.json:
                sys.stdout.write("\n")
            return 0
        results = client.generate_all(args.prompt, **params)
    except TritiumClientError as e:
        raise ValueError(f"server: {e}") from None
    except OSError as e:
        raise OSError(f"cannot reach tritonserver at {args.url} ({args.protocol}): {e}") from None
    for i, result in enumerate(results):  # one per sample (--n)
        if args.json:
            out = {"text": result.text, "token_ids": result.token_ids, "finish_reason": result.finish_reason,
                   "num_input_tokens": result.num_input_tokens, "num_output_tokens": result.num_output_tokens}
            if len(results) > 1:
                out["index"] = i
            if params.get("return_log_probs"):
                out["logprobs"] = result.log_probs
                out["cum_logprob"] = result.cum_log_prob
            print(json.dumps(out, ensure_ascii=False))
        else:
            sys.stdout.write(result.text + "\n")
    return 0
