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
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

from tritium.backend.errors import RequestError
from tritium.backend.guided.surfaces import to_tensors
from tritium.client.cli.generate_inputs import (chat_messages, field_kwargs, guide_from_args, parse_prompt_ids,
                                                read_input_file, wire_json)

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
    g.add_argument("--api-key", default=None,
                   help="the server's API key, sent as 'Authorization: Bearer KEY' (default: $TRITIUM_API_KEY)")
    g.add_argument("--tls-ca", default=None, help="TLS: trust this PEM certificate (the server's --tls-cert)")


def request_params(args: argparse.Namespace, overrides: Optional[dict] = None) -> dict:
    """The CLI's request-field flags (and an --input-file line's keys) as the tensor contract's
    `sampling_parameters` JSON; the fields are checked here first, so a bad flag fails before any
    request goes out, with the same error as in-process."""
    from tritium.backend.sampling_params import SamplingParams
    kw = field_kwargs(args, overrides)
    guide = guide_from_args(args)
    SamplingParams(**kw, guided=guide)
    params = {"sampling_parameters": json.dumps(wire_json(kw))}
    params.update(to_tensors(guide))  # --json-schema / --regex / --choice / --grammar
    if kw.get("logprobs") is not None:
        params["return_log_probs"] = True
    return params


def _result(c, n: int, logprobs: bool) -> dict:
    d = {"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
         "num_input_tokens": c.num_input_tokens, "num_output_tokens": c.num_output_tokens}
    if n > 1:
        d["index"] = c.index
    if logprobs:
        d["logprobs"] = c.log_probs
        d["cum_logprob"] = c.cum_log_prob
    return d


def run_remote(args: argparse.Namespace) -> int:
    """Send the request(s); print text (streamed live with --stream) or JSON lines (--json, --input-file)."""
    from tritium.client.triton_client import TritiumClient, TritiumClientError, TritonUnreachableError
    if getattr(args, "stats", False):
        raise ValueError("--stats reports an in-process engine; for a server read its /metrics endpoint")
    if getattr(args, "speculative_method", None) or getattr(args, "draft_engine_dir", None):
        raise ValueError("--speculative configures an in-process engine; a server speculates when its model "
                         "config says so (tritium build --repo ... --speculative ngram|draft)")
    if getattr(args, "input_file", None):
        if args.prompt is not None or getattr(args, "prompt_ids", None):
            raise ValueError("--input-file replaces PROMPT and --prompt-ids; give only one")
        items = [((p.get("prompt"), p.get("prompt_token_ids")), o) for p, o in read_input_file(args.input_file)]
    elif args.prompt is not None or getattr(args, "prompt_ids", None):
        ids = parse_prompt_ids(args.prompt_ids) if getattr(args, "prompt_ids", None) else None
        items = [((None if ids else args.prompt, ids), {})]
    else:
        raise ValueError("give a PROMPT, --prompt-ids or --input-file")
    if getattr(args, "chat", False):  # the server renders its engine's chat template (the `messages` input)
        if any(p is None for (p, _), _ in items):
            raise ValueError("--chat needs text prompts (an --input-file line has prompt_ids)")
        items = [((None, None, json.dumps(chat_messages(args, p), ensure_ascii=False)), o) for (p, _), o in items]
    else:
        items = [((p, ids, None), o) for (p, ids), o in items]
    client = TritiumClient(args.url, protocol=args.protocol, model=args.model, api_key=getattr(args, "api_key", None),
                           tls_ca=getattr(args, "tls_ca", None))
    n = getattr(args, "n", None) or 1
    want_lp = getattr(args, "logprobs", None) is not None
    try:
        if args.stream and len(items) == 1 and not args.json:
            (prompt, ids, msgs), o = items[0]
            for c in client.stream(prompt, input_ids=ids, messages=msgs, **request_params(args, o)):
                sys.stdout.write(c.text)
                sys.stdout.flush()
            sys.stdout.write("\n")
            return 0
        # All requests go out together, so the server batches them in flight; results in input order.
        results = [None] * len(items)
        with ThreadPoolExecutor(max_workers=min(32, len(items))) as pool:
            futures = [pool.submit(client.generate_all, prompt, input_ids=ids, messages=msgs,
                                   **request_params(args, o))
                       for (prompt, ids, msgs), o in items]
            for i, f in enumerate(futures):
                results[i] = f.result()
    except TritiumClientError as e:  # keeps the server's error code and field
        raise RequestError(f"server: {e.message}", field=e.field, code=e.code) from None
    except TritonUnreachableError as e:
        raise OSError(str(e)) from None
    except OSError as e:
        raise OSError(f"cannot reach tritonserver at {args.url} ({args.protocol}): {e}") from None
    as_json = args.json or getattr(args, "input_file", None) is not None
    for comps in results:
        for c in comps:
            if as_json:
                print(json.dumps(_result(c, n, want_lp), ensure_ascii=False))
            else:
                if n > 1:
                    print(f"--- sample {c.index} ({c.finish_reason})")
                sys.stdout.write(c.text + "\n")
    return 0
