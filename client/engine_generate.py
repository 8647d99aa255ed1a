"""`tritium generate --engine`: the in-process path, on the in-flight LLMEngine.

One prompt (text or --prompt-ids), or --input-file F.jsonl with one request per line:
    {"prompt": "..."} or {"prompt_ids": [1, 2, 3]}, plus optional "max_tokens", "temperature",
    "top_p", "top_k", "seed", "stop" (string or list of strings)
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

from tritium.backend.speculative.config import DEFAULT_NUM_SPECULATIVE_TOKENS, METHODS, SpeculativeConfig
from tritium.client.generate_inputs import chat_messages, guide_from_args, parse_prompt_ids, read_input_file


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("in-process engine (--engine)")
    g.add_argument("--stop", action="append", default=[], metavar="STR",
                   help="stop string (repeatable); it is not included in the output")
    g.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="return the sampled token's logprob plus the top N per token (raw model log-softmax)")
    g.add_argument("--n", type=int, default=1, metavar="N", help="parallel samples per prompt (default 1)")
    g.add_argument("--min-p", type=float, default=0.0, help="min-p sampling threshold in [0, 1] (default 0)")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="CTRL repetition penalty (default 1)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    g.add_argument("--input-file", default=None, metavar="F.jsonl",
                   help='one request per line: {"prompt": ...} or {"prompt_ids": [...]} plus optional '
                        'max_tokens, temperature, top_p, top_k, seed, stop')
    g.add_argument("--stats", action="store_true", help="after the results, print engine stats as one JSON object")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache blocks (default: sized from memory)")
    g.add_argument("--max-num-seqs", type=int, default=None, help="max sequences per step (default: engine max batch)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget per step (default 2048)")
    g.add_argument("--speculative", default=None, choices=METHODS,
                   help="speculative decoding: ngram (prompt lookup) or draft (--draft-engine proposes); "
                        "output is the same as without (greedy) or has the same distribution (sampling)")
    g.add_argument("--draft-engine", default=None, metavar="DIR",
                   help="draft engine for --speculative draft (same tokenizer, e.g. an int4 build of the model)")
    g.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   help=f"tokens proposed per step, 1..16 (default {DEFAULT_NUM_SPECULATIVE_TOKENS})")
    g.add_argument("--lora", action="append", default=[], metavar="NAME=PATH",
                   help="serve a PEFT LoRA adapter folder under NAME (repeatable; docs/lora.md); the prompts "
                        "use it (with several, pick one with --lora-name)")
    g.add_argument("--max-lora-rank", type=int, default=None, metavar="R",
                   help="largest adapter rank per module the engine takes (default 16)")


def speculative_config(args):
    """--speculative / --draft-engine / --num-speculative-tokens -> SpeculativeConfig or None (checked)."""
    method = getattr(args, "speculative", None)
    draft, k = getattr(args, "draft_engine", None), getattr(args, "num_speculative_tokens", None)
    if method is None:
        if draft is not None or k is not None:
            raise ValueError("--draft-engine and --num-speculative-tokens need --speculative ngram|draft")
        return None
    return SpeculativeConfig(method, num_speculative_tokens=DEFAULT_NUM_SPECULATIVE_TOKENS if k is None else k,
                             draft_engine_dir=draft).validate()


def lora_options(args):
    """--lora NAME=PATH (repeatable) / --lora-name / --max-lora-rank -> (LoRAConfig or None, the prompts' adapter)."""
    from tritium.backend.lora.adapter import DEFAULT_MAX_LORA_RANK, parse_lora_spec
    from tritium.backend.lora.manager import LoRAConfig
    adapters = dict(parse_lora_spec(s) for s in getattr(args, "lora", []) or [])
    name = getattr(args, "lora_name", None)
    if not adapters:
        if name is not None or getattr(args, "max_lora_rank", None) is not None:
            raise ValueError("--lora-name and --max-lora-rank need --lora NAME=PATH (with --engine)")
        return None, None
    if name is None:
        if len(adapters) > 1:
            raise ValueError(f"several --lora adapters ({', '.join(adapters)}): pick the prompts' one with --lora-name")
        name = next(iter(adapters))
    elif name not in adapters:
        raise ValueError(f"--lora-name {name!r} is not among the --lora adapters ({', '.join(adapters)})")
    rank = args.max_lora_rank if args.max_lora_rank is not None else DEFAULT_MAX_LORA_RANK
    return LoRAConfig(adapters, max_lora_rank=rank), name


def _params(args, overrides: dict):
    from tritium.backend.sampling_params import SamplingParams
    stop = overrides.get("stop", args.stop)
    return SamplingParams(
        max_tokens=overrides.get("max_tokens", args.max_tokens),
        temperature=overrides.get("temperature", args.temperature),
        top_k=overrides.get("top_k", args.top_k), top_p=overrides.get("top_p", args.top_p),
        seed=overrides.get("seed", args.seed), min_p=args.min_p, repetition_penalty=args.repetition_penalty,
        ignore_eos=args.ignore_eos, stop=[stop] if isinstance(stop, str) else list(stop),
        logprobs=args.logprobs, n=args.n, guided=guide_from_args(args))


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
    spec = speculative_config(args)
    lora, lora_name = lora_options(args)
    engine = LLMEngine(args.engine, num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens, device=args.device, speculative=spec,
                       lora=lora)
    for i, (prompt, overrides) in enumerate(items):
        try:
            engine.add_request(str(i), params=_params(args, overrides), lora_name=lora_name, **prompt)
        except ValueError as e:
            where = f"{args.input_file}: request {i + 1}: " if args.input_file else ""
            raise ValueError(f"{where}{e}") from None
    stream = getattr(args, "stream", False) and len(items) == 1 and args.n == 1 and not args.json
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
                print(json.dumps(_result(out, comp, args.logprobs is not None, args.n), ensure_ascii=False))
            elif stream:
                sys.stdout.write("\n")
            else:
                if args.n > 1:
                    print(f"--- sample {comp.index} ({comp.finish_reason})")
                sys.stdout.write(comp.text + "\n")
    if args.stats:
        stats = engine.stats()
        stats["kv_blocks_used_peak"] = peak
        print(json.dumps(stats, sort_keys=True))
    return 0
