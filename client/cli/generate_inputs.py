"""Inputs of `tritium generate`, shared by the in-process and the server paths: the request-field
flags (derived from the schema in backend/sampling_params.py), --prompt-ids, --input-file F.jsonl
and --chat / --system; structured outputs --json-schema FILE, --regex RX, --choice TEXT
(repeatable), --grammar FILE."""
from __future__ import annotations

import argparse
import json
from typing import Any, Dict, List, Tuple

from tritium.backend.sampling_params import FIELDS


def add_field_arguments(p: argparse.ArgumentParser) -> None:
    """One flag per request field that declares `cli` (dest: the field name)."""
    g = p.add_argument_group("request fields (the same names, ranges and defaults on every surface; docs/cli.md)")
    for f in FIELDS:
        if not f.cli:
            continue
        rng = f" in {f.range_text()}" if f.kind in ("int", "float") else ""
        default = f.default_for_cli
        shown = "" if default is None or default == [] else f"; default {default}"
        help_ = f"{f.doc}{rng}{shown}"
        if f.kind == "bool":
            g.add_argument(f.cli, dest=f.name, action="store_true", default=None, help=help_)
        elif f.kind in ("words", "ids"):
            g.add_argument(f.cli, dest=f.name, action="append", type=f.cli_type(), default=None,
                           metavar=f.name.upper()[:-1] if f.name.endswith("s") else f.name.upper(),
                           help=f"{help_} (repeatable)")
        elif f.kind == "bias":
            g.add_argument(f.cli, dest=f.name, type=json.loads, default=None, metavar="JSON",
                           help=f"{help_}, as JSON, e.g. '{{\"50256\": -100}}'")
        else:
            g.add_argument(f.cli, dest=f.name, type=f.cli_type(), default=None, metavar="N" if f.kind == "int" else "X",
                           help=help_)


def add_guide_arguments(p) -> None:
    """--json-schema / --regex / --choice / --grammar (structured outputs, docs/structured-outputs.md)."""
    g = p.add_argument_group("structured outputs (one of)")
    g.add_argument("--json-schema", default=None, metavar="FILE",
                   help="the output is JSON valid against this JSON Schema file")
    g.add_argument("--regex", default=None, metavar="RX", help="the output matches this regular expression")
    g.add_argument("--choice", action="append", default=None, metavar="TEXT",
                   help="the output is exactly one of these strings (repeat the flag for each)")
    g.add_argument("--grammar", default=None, metavar="FILE", help="the output follows this EBNF (GBNF) grammar file")


def guide_from_args(args):
    """The GuidedDecodingParams of --json-schema / --regex / --choice / --grammar, or None."""
    from tritium.backend.guided.params import GuidedDecodingParams, json_schema
    given = [f for f in ("json_schema", "regex", "choice", "grammar") if getattr(args, f, None)]
    if len(given) > 1:
        raise ValueError("give one of --json-schema, --regex, --choice and --grammar, got "
                         + ", ".join("--" + f.replace("_", "-") for f in given))
    if not given:
        return None
    if args.json_schema:
        with open(args.json_schema, encoding="utf-8") as f:
            return json_schema(f.read(), "--json-schema")
    if args.regex:
        return GuidedDecodingParams("regex", args.regex, "--regex").validate()
    if args.choice:
        return GuidedDecodingParams("choice", tuple(args.choice), "--choice").validate()
    with open(args.grammar, encoding="utf-8") as f:
        return GuidedDecodingParams("ebnf_grammar", f.read(), "--grammar").validate()


def field_kwargs(args: argparse.Namespace, overrides: Dict[str, Any] = None) -> Dict[str, Any]:
    """SamplingParams keyword arguments from the flags, then an --input-file line's keys (which win);
    a flag left out takes the field's CLI default."""
    o = overrides or {}
    kw: Dict[str, Any] = {}
    for f in FIELDS:
        if f.json_key in o:
            kw[f.name] = f.from_json(o[f.json_key], f.json_key)
        elif f.cli and getattr(args, f.name, None) is not None:
            kw[f.name] = getattr(args, f.name)
        elif f.cli and f.default_for_cli != f.default:
            kw[f.name] = f.default_for_cli
    return kw


def wire_json(kw: Dict[str, Any]) -> Dict[str, Any]:
    """SamplingParams kwargs -> vllm_backend `sampling_parameters` JSON (json keys)."""
    out = {}
    for f in FIELDS:
        if f.name in kw and f.json_key:
            v = kw[f.name]
            out[f.json_key] = {str(k): b for k, b in v.items()} if f.kind == "bias" and v else v
    return out


def chat_messages(args, text: str) -> list:
    """--chat: the messages for one user prompt (after --system when given)."""
    msgs = [{"role": "system", "content": args.system}] if getattr(args, "system", None) is not None else []
    return msgs + [{"role": "user", "content": text}]


def parse_prompt_ids(s: str):
    try:
        ids = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--prompt-ids must be comma-separated integers, got {s!r}") from None
    if not ids:
        raise ValueError("--prompt-ids is empty")
    return ids


FILE_KEYS = {"prompt", "prompt_ids"} | {f.json_key for f in FIELDS if f.json_key}


def read_input_file(path: str) -> List[Tuple[dict, dict]]:
    """[(prompt kwargs, param overrides)] from a JSONL file; errors name the line and key."""
    reqs = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{where}: expected a JSON object")
            unknown = sorted(set(obj) - FILE_KEYS)
            if unknown:
                raise ValueError(f"{where}: unknown key {unknown[0]!r}; allowed: {', '.join(sorted(FILE_KEYS))}")
            if ("prompt" in obj) == ("prompt_ids" in obj):
                raise ValueError(f"{where}: give exactly one of 'prompt' and 'prompt_ids'")
            prompt = {"prompt": obj["prompt"]} if "prompt" in obj else {"prompt_token_ids": obj["prompt_ids"]}
            reqs.append((prompt, {k: v for k, v in obj.items() if k not in ("prompt", "prompt_ids")}))
    if not reqs:
        raise ValueError(f"{path}: no requests")
    return reqs
