"""The hostile-client cases of tests/test_security_*.py, as tables, and a tally of what came back.

Each OpenAI case is (name, path, body, field): `body` is a dict (sent as JSON) or raw bytes; the
answer must be 4xx (or 503) and its error must name `field` (in `param` or the message). To add
cases for a new request field (structured output: `response_format` schemas and grammars; LoRA:
adapter names), append rows to OPENAI_FIELD_CASES (or extend EXTRA_OPENAI_CASES from another
module); every test that walks the table picks them up.
"""
from __future__ import annotations

import collections
import http.client
import json
import ssl
from typing import Optional

MODEL = "tiny"
MSG = [{"role": "user", "content": "hi"}]


def chat(**kw) -> dict:
    return dict({"model": MODEL, "messages": MSG, "max_tokens": 2}, **kw)


def comp(**kw) -> dict:
    return dict({"model": MODEL, "prompt": "hi", "max_tokens": 2}, **kw)


DEEP = b'{"model":"tiny","messages":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
CHAT, COMP = "/v1/chat/completions", "/v1/completions"

OPENAI_BODY_CASES = [  # malformed bodies: the field named is the body itself
    ("not JSON", CHAT, b"{not json", "JSON"),
    ("JSON array", CHAT, b"[1, 2]", "JSON object"),
    ("invalid UTF-8", CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff\xfe"}]}', "JSON"),
    ("deep nesting 100,000", CHAT, DEEP, "JSON"),
    ("huge number", COMP, b'{"model": "tiny", "prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}", "max_tokens"),
    ("empty body", COMP, b"", "JSON"),
    ("NaN literal", COMP, b'{"model": "tiny", "prompt": "hi", "temperature": NaN}', "temperature"),
]

OPENAI_FIELD_CASES = [
    ("no model", CHAT, {"messages": MSG}, "model"),
    ("model wrong type", CHAT, chat(model=["tiny"]), "model"),
    ("unknown model", CHAT, chat(model="../../etc/passwd"), "model"),
    ("messages wrong type", CHAT, chat(messages="hi"), "messages"),
    ("message wrong type", CHAT, chat(messages=[5]), "messages"),
    ("role unknown", CHAT, chat(messages=[{"role": "root", "content": "hi"}]), "role"),
    ("content wrong type", CHAT, chat(messages=[{"role": "user", "content": {"a": 1}}]), "content"),
    ("lone surrogate", CHAT, chat(messages=[{"role": "user", "content": "\ud800"}]), "content"),
    ("thousands of messages", CHAT, chat(messages=MSG * 5000), "messages"),
    ("empty messages", CHAT, chat(messages=[]), "messages"),
    ("n absurd", CHAT, chat(n=10 ** 9), "n"),
    ("n negative", CHAT, chat(n=-1), "n"),
    ("n wrong type", CHAT, chat(n="2"), "n"),
    ("max_tokens absurd", CHAT, chat(max_tokens=10 ** 12), "max_tokens"),
    ("max_tokens zero", COMP, comp(max_tokens=0), "max_tokens"),
    ("max_tokens float", COMP, comp(max_tokens=2.5), "max_tokens"),
    ("max_completion_tokens absurd", CHAT, chat(max_completion_tokens=2 ** 63), "max_completion_tokens"),
    ("top_logprobs absurd", CHAT, chat(logprobs=True, top_logprobs=10 ** 6), "top_logprobs"),
    ("top_logprobs without logprobs", CHAT, chat(top_logprobs=2), "top_logprobs"),
    ("completion logprobs absurd", COMP, comp(logprobs=10 ** 6), "logprobs"),
    ("logit_bias wrong type", CHAT, chat(logit_bias=[1, 2]), "logit_bias"),
    ("logit_bias bad id", CHAT, chat(logit_bias={"abc": 1}), "logit_bias"),
    ("logit_bias out of vocabulary", CHAT, chat(logit_bias={str(10 ** 12): 5}), "logit_bias"),
    ("logit_bias huge value", CHAT, chat(logit_bias={"1": 1e300}), "logit_bias"),
    ("logit_bias 100,000 entries", CHAT, chat(logit_bias={str(i): 1 for i in range(100_000)}), "logit_bias"),
    ("temperature negative", CHAT, chat(temperature=-1), "temperature"),
    ("temperature string", CHAT, chat(temperature="hot"), "temperature"),
    ("top_p above 1", CHAT, chat(top_p=5), "top_p"),
    ("stop too many", CHAT, chat(stop=["x"] * 10_000), "stop"),
    ("stop wrong type", CHAT, chat(stop=5), "stop"),
    ("seed huge", CHAT, chat(seed=2 ** 80), "seed"),
    ("prompt list of ints out of range", COMP, comp(prompt=[10 ** 12]), "prompt"),
    ("prompt id that would wrap to int32", COMP, comp(prompt=[2 ** 32 + 5]), "prompt"),
    ("prompt wrong type", COMP, comp(prompt={"a": 1}), "prompt"),
    ("prompts too many", COMP, comp(prompt=["hi"] * 10_000), "prompt"),
    ("prompt 2 MB", COMP, comp(prompt="a " * 1_000_000), "prompt"),
    ("stream wrong type", CHAT, chat(stream="yes"), "stream"),
    ("stream_options wrong type", CHAT, chat(stream=True, stream_options=5), "stream_options"),
    ("tools", CHAT, chat(tools=[{"type": "function"}]), "tools"),
    ("response_format wrong type", CHAT, chat(response_format=5), "response_format"),
    # Structured output (response_format json_schema / grammars) and LoRA (adapter names) add
    # their rows here as those fields land.
]
EXTRA_OPENAI_CASES: list = []  # filled by other modules (structured output, LoRA) at import time


def openai_cases():
    return OPENAI_BODY_CASES + OPENAI_FIELD_CASES + EXTRA_OPENAI_CASES


class Tally:
    """Requests tried and statuses seen, per surface; printed as the suite's figures."""

    def __init__(self):
        self.statuses = collections.defaultdict(collections.Counter)

    def add(self, surface: str, status) -> None:
        self.statuses[surface][status] += 1

    def total(self) -> int:
        return sum(sum(c.values()) for c in self.statuses.values())

    def bad(self) -> list:
        """Answers that break the rule: a 5xx other than 503."""
        return [(s, k) for s, c in self.statuses.items() for k in c if isinstance(k, int) and k >= 500 and k != 503]

    def table(self) -> str:
        rows = ["| surface | requests | statuses seen |", "|---|---|---|"]
        for s, c in sorted(self.statuses.items()):
            rows.append(f"| {s} | {sum(c.values()):,} | "
                        + ", ".join(f"{k}: {v:,}" for k, v in sorted(c.items(), key=lambda kv: str(kv[0]))) + " |")
        return "\n".join(rows)


def request(url: str, method: str, path: str, body: Optional[bytes] = None, headers: Optional[dict] = None,
            tls: bool = False, timeout: float = 120):
    """(status, parsed JSON or text, raw bytes) of one request on a fresh connection."""
    host, port = url.split("://")[-1].split("/")[0].rsplit(":", 1)
    if tls:
        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        conn = http.client.HTTPSConnection(host, int(port), timeout=timeout, context=ctx)
    else:
        conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        h = dict(headers or {})
        if body is not None:
            h.setdefault("Content-Type", "application/json")
        conn.request(method, path, body=body, headers=h)
        r = conn.getresponse()
        raw = r.read()
    finally:
        conn.close()
    try:
        return r.status, json.loads(raw), raw
    except ValueError:
        return r.status, raw.decode("utf-8", "replace"), raw


def error_text(parsed) -> str:
    """The error of an OpenAI ({"error": {...}}) or Triton ({"error": "..."}) answer as one string."""
    if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
        e = parsed["error"]
        return f"{e.get('param')} {e.get('message')}"
    if isinstance(parsed, dict):
        return str(parsed.get("error"))
    return str(parsed)
