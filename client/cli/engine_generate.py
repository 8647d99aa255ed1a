"""`tritium generate --engine`: the in-process path, on the in-flight LLMEngine.

One prompt (text or --prompt-ids), or --input-file F.jsonl with one request per line:
    {"prompt": "..."} or {"prompt_ids": [1, 2, 3]}, plus any request field by its
    sampling_parameters key ("max_tokens", "temperature", "stop", ...)
All requests run together through the engine; results print as one JSON object per request
(per sample when --n > 1), in input order:
    {"text", "token_ids", "prompt_token_ids", "finish_reason"} (+ "index" for n > 1, + "logprobs")
--stats then prints one JSON object of engine stats (with --speculative: spec_proposed_tokens,
spec_accepted_tokens, spec_acceptance_rate; tokens per step = num_generated_tokens / num_steps).
"""
from __future__ import annotations

import argparse
import json
import sys

from tritium.backend.engine_options import (SPECULATIVE, add_lora_arguments, add_option_arguments, engine_setup,
                                            lora_adapters_from_args, lora_config, options_from_args)
from tritium.backend.errors import RequestError, error_info
from tritium.client.cli.generate_inputs import (chat_messages, field_kwargs, guide_from_args, parse_prompt_ids,
                                                read_input_file)

# The engine options `tritium generate --engine` takes (backend/engine_options.py).
ENGINE_FLAGS = ("num_kv_blocks", "max_num_seqs", "max_num_batched_tokens", "device", "device_sampling",
                "cuda_graphs", "activation_quant", "max_decode_burst") + SPECULATIVE
LORA_LIMITS = ("max_lora_rank",)  # beside --lora NAME=PATH


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("in-process engine (--engine)")
    g.add_argument("--input-file", default=None, metavar="F.jsonl",
                   help='one request per line: {"prompt": ...} or {"prompt_ids": [...]} plus any request '
                        'field by its sampling_parameters key (max_tokens, temperature, stop, ...)')
    g.add_argument("--stats", action="store_true", help="after the results, print engine stats as one JSON object")
    add_option_arguments(p, ENGINE_FLAGS, "in-process engine options (docs/cli.md)")
    add_lora_arguments(p, LORA_LIMITS, "LoRA adapters in-process (docs/lora.md; with several --lora, the prompts' "
                                       "one is --lora-name)")


def lora_options(args):
    """--lora NAME=PATH (repeatable) / --lora-name / --max-lora-rank -> (LoRAConfig or None, the prompts' adapter)."""
    adapters = lora_adapters_from_args(args)
    limits = options_from_args(args, LORA_LIMITS)
    name = getattr(args, "lora_name", None)
    if not adapters:
        if name is not None or limits:
            raise ValueError("--lora-name and --max-lora-rank need --lora NAME=PATH (with --engine)")
        return None, None
    if name is None:
        if len(adapters) > 1:
            raise ValueError(f"several --lora adapters ({', '.join(adapters)}): pick the prompts' one with --lora-name")
        name = next(iter(adapters))
    elif name not in adapters:  # what the engine answers for an adapter it does not serve: the field named
        raise RequestError(f"unknown LoRA adapter {name!r}; the --lora adapters: {', '.join(adapters)}",
                           field="lora_name")
    cfg = lora_config({"lora_adapters": ",".join(f"{n}={p}" for n, p in adapters.items()), **limits})
    return cfg, name


def _params(args, overrides: dict):
    from tritium.backend.sampling_params import SamplingParams
    return SamplingParams(**field_kwargs(args, overrides), guided=guide_from_args(args))


def _result(out, comp, logprobs: bool, n: int) -> dict:
    d = {"text": comp.text, "token_ids": comp.token_ids, "prompt_token_ids": out.prompt_token_ids,
         "finish_reason": comp.finish_reason}
    if n > 1:
        d["index"] = comp.index
    if logprobs:
        d["logprobs"] = comp.logprobs
    return d


def _apply_chat_template(args: argparse.Namespace, items: list) -> list:
    """--chat: each text prompt becomes a user message, rendered with the engine's chat template."""
    from tritium.backend.chat_template import ChatTemplate
    tpl = ChatTemplate.from_engine_dir(args.engine)  # NoChatTemplateError (a ValueError) names the engine
    out = []
    for prompt, overrides in items:
        if "prompt" not in prompt:
            raise ValueError("--chat needs text prompts (an --input-file line has prompt_ids)")
        out.append(({"prompt": tpl.render(chat_messages(args, prompt["prompt"]))}, overrides))
    return out


def run_engine(args: argparse.Namespace) -> int:
    """The --engine path of `tritium generate`."""
    from tritium.backend.engine import LLMEngine
    if args.input_file is not None:
        if args.prompt is not None or args.prompt_ids is not None:
            raise ValueError("--input-file replaces PROMPT and --prompt-ids; give only one")
        items = read_input_file(args.input_file)
    elif args.prompt is not None or args.prompt_ids is not None:
        prompt = ({"prompt_token_ids": parse_prompt_ids(args.prompt_ids)} if args.prompt_ids is not None
                  else {"prompt": args.prompt})
        items = [(prompt, {})]
    else:
        raise ValueError("give a PROMPT, --prompt-ids or --input-file")
    if getattr(args, "chat", False):
        items = _apply_chat_template(args, items)
    setup = engine_setup(options_from_args(args, ENGINE_FLAGS))
    lora, lora_name = lora_options(args)
    engine = LLMEngine(args.engine, thread_policy=setup.thread_policy, lora=lora, **setup.engine_kwargs)
    for i, (prompt, overrides) in enumerate(items):
        try:
            sp = _params(args, overrides)  # an --input-file line's lora_name wins over the default adapter
            engine.add_request(str(i), params=sp, lora_name=None if sp.lora_name else lora_name, **prompt)
        except ValueError as e:  # the message names the request line; the code and field stay
            if not args.input_file:
                raise
            info = error_info(e)
            raise RequestError(f"{args.input_file}: request {i + 1}: {info['message']}", field=info["field"],
                               code=info["code"]) from None
    n = args.n or 1
    stream = getattr(args, "stream", False) and len(items) == 1 and n == 1 and not args.json
    final, peak = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            if stream:
                sys.stdout.write(out.outputs[0].text_delta)
                sys.stdout.flush()
            if out.finished:
                final[int(out.request_id)] = out
        peak = max(peak, engine.stats()["kv_blocks_used"])
    as_json = args.json or args.input_file is not None
    for i in range(len(items)):
        out = final[i]
        for comp in out.outputs:
            if as_json:
                print(json.dumps(_result(out, comp, args.logprobs is not None, n), ensure_ascii=False))
            elif stream:
                sys.stdout.write("\n")
            else:
                if n > 1:
                    print(f"--- sample {comp.index} ({comp.finish_reason})")
                sys.stdout.write(comp.text + "\n")
    if args.stats:
        stats = engine.stats()
        stats["kv_blocks_used_peak"] = peak
        print(json.dumps(stats, sort_keys=True))
    return 0
