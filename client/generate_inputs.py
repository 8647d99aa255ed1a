"""Prompt inputs of `tritium generate`, shared by the in-process and the server paths:
--prompt-ids, --input-file F.jsonl and --chat / --system."""
from __future__ import annotations

import json
from typing import List, Tuple


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


FILE_KEYS = {"prompt", "prompt_ids", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop"}


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
