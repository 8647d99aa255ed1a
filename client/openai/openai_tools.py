"""OpenAI tool calling: `tools` / `tool_choice` checks, the grammar that forces a call, and the
parsers that turn generated text into `tool_calls` (docs/openai.md, docs/structured-outputs.md).

Formats (picked from the chat template, or by `tritium openai --tool-call-parser`):
  hermes   <tool_call>{"name": ..., "arguments": {...}}</tool_call>   (Hermes, Qwen 2/2.5/3)
  llama3   {"name": ..., "parameters": {...}}, optionally after <|python_tag|>   (Llama 3.x JSON)
  mistral  [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]   (Mistral)
tool_choice "required" and a named function are enforced by a grammar (one call, in the
model's format, its arguments held to the tool's JSON schema), so the call always parses;
"auto" lets the model write text or a call (parsed when it parses); "none" sends no tools.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from tritium.backend.guided.params import GuidedDecodingParams, json_schema

FORMATS = ("hermes", "llama3", "mistral")
MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_ARGS_KEY = {"hermes": "arguments", "llama3": "parameters", "mistral": "arguments"}
_WRAP = {"hermes": ("<tool_call>\n", "\n</tool_call>"), "llama3": ("", ""), "mistral": ("[TOOL_CALLS][", "]")}
MARKERS = {"hermes": "<tool_call>", "llama3": "<|python_tag|>", "mistral": "[TOOL_CALLS]"}


class ToolError(ValueError):
    """A bad tools / tool_choice value; `param` names the field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass
class ToolRequest:
    tools: List[dict]                # the request's tools, checked
    choice: str                      # "auto" | "required" | "named"
    name: Optional[str] = None       # the named function
    format: str = "hermes"
    names: List[str] = field(default_factory=list)

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "named")


def detect_format(template_source: Optional[str]) -> str:
    """The tool-call format a chat template writes (hermes when it cannot tell)."""
    src = template_source or ""
    if "[TOOL_CALLS]" in src:
        return "mistral"
    if "<tool_call>" in src:
        return "hermes"
    if "<|python_tag|>" in src or "ipython" in src:
        return "llama3"
    return "hermes"


def parse_tools(body: dict, fmt: str = "hermes") -> Optional[ToolRequest]:
    """tools + tool_choice of a chat request -> ToolRequest (None: no tools, or tool_choice none)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise ToolError("tool_choice", "tool_choice needs tools")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ToolError("tools", f"tools must be a list of at most {MAX_TOOLS} function tools")
    names = []
    for i, t in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise ToolError(at, f'{at} must be {{"type": "function", "function": {{"name", "parameters"}}}}')
        fn = t["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ToolError(f"{at}.function.name", f"{at}.function.name must be 1-64 letters, digits, _ . or -, "
                                                   f"got {name!r}")
        if name in names:
            raise ToolError(f"{at}.function.name", f"{at}.function.name {name!r} is given twice")
        names.append(name)
        try:  # the schema must convert to a grammar (it constrains forced calls)
            json_schema(fn.get("parameters", {"type": "object"}), f"{at}.function.parameters").grammar()
        except ValueError as e:
            raise ToolError(f"{at}.function.parameters", str(e)) from None
    if choice in (None, "auto"):
        return ToolRequest(tools, "auto", format=fmt, names=names)
    if choice == "none":
        return None
    if choice == "required":
        return ToolRequest(tools, "required", format=fmt, names=names)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise ToolError("tool_choice", f"tool_choice names function {name!r}, which is not in tools "
                                           f"({', '.join(names)})")
        return ToolRequest(tools, "named", name=name, format=fmt, names=names)
    raise ToolError("tool_choice", 'tool_choice must be "none", "auto", "required" or '
                                   '{"type": "function", "function": {"name": NAME}}')


def call_guide(tr: ToolRequest) -> GuidedDecodingParams:
    """The grammar of exactly one call (to tr.name, or to any tool when required) in tr.format."""
    from tritium.backend.guided.xgr import xgrammar
    xgr = xgrammar()
    key = _ARGS_KEY[tr.format]
    alts = []
    for t in tr.tools:
        fn = t["function"]
        if tr.choice == "named" and fn["name"] != tr.name:
            continue
        alts.append({"type": "object", "properties": {"name": {"const": fn["name"]},
                                                      key: fn.get("parameters") or {"type": "object"}},
                     "required": ["name", key], "additionalProperties": False})
    schema = alts[0] if len(alts) == 1 else {"anyOf": alts}
    body = json_schema(schema, "tools").grammar()
    head, tail = _WRAP[tr.format]
    parts = [xgr.Grammar.from_ebnf(f"root ::= {json.dumps(head)}")] if head else []
    parts.append(body)
    if tail:
        parts.append(xgr.Grammar.from_ebnf(f"root ::= {json.dumps(tail)}"))
    grammar = xgr.Grammar.concat(*parts) if len(parts) > 1 else body
    return GuidedDecodingParams("ebnf_grammar", str(grammar), "tools").validate()


def _call(obj, tr: ToolRequest) -> Optional[dict]:
    if not isinstance(obj, dict) or obj.get("name") not in tr.names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


def _loads(text: str):
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def parse_calls(text: str, tr: ToolRequest) -> Tuple[Optional[str], List[dict]]:
    """(content, tool_calls) from generated text. Text that does not parse as a call stays content."""
    calls: List[dict] = []
    content = text
    if tr.format == "hermes":
        found = list(_HERMES.finditer(text))
        for m in found:
            c = _call(_loads(m.group(1)), tr)
            if c is None:
                return text, []
            calls.append(c)
        if found:
            content = text[:found[0].start()]
    elif tr.format == "mistral":
        at = text.find("[TOOL_CALLS]")
        if at >= 0:
            v = _loads(text[at + len("[TOOL_CALLS]"):].strip())
            items = v if isinstance(v, list) else [v]
            calls = [c for c in (_call(o, tr) for o in items) if c is not None]
            if len(calls) != len(items) or not calls:
                return text, []
            content = text[:at]
    else:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if body.startswith("{"):
            items = [_loads(p) for p in body.split(";")] if ";" in body and _loads(body) is None else [_loads(body)]
            calls = [c for c in (_call(o, tr) for o in items) if c is not None]
            if len(calls) != len(items) or not calls:
                return text, []
            content = ""
    content = content.strip()
    return (content or None) if calls else text, calls


def held_from(text: str, tr: ToolRequest) -> int:
    """Streaming with tools: text before this index can go out as content now; the rest may be
    (the start of) a call and is held until the choice finishes."""
    if tr.forced:
        return 0
    if tr.format == "llama3" and text.lstrip()[:1] in ("{", "<"):
        return 0
    marker = MARKERS[tr.format]
    at = text.find(marker)
    if at >= 0:
        return at
    for k in range(min(len(marker) - 1, len(text)), 0, -1):  # a marker may be starting at the end
        if marker.startswith(text[-k:]):
            return len(text) - k
    return len(text)


def call_deltas(calls: List[dict]) -> List[dict]:
    """Stream deltas for finished calls, as the OpenAI SDK assembles them: per call, a first delta
    with index, id, type and name, then its arguments in pieces."""
    out = []
    for i, c in enumerate(calls):
        out.append({"tool_calls": [{"index": i, "id": c["id"], "type": "function",
                                    "function": {"name": c["function"]["name"], "arguments": ""}}]})
        args = c["function"]["arguments"]
        half = len(args) // 2
        for piece in (args[:half], args[half:]):
            if piece:
                out.append({"tool_calls": [{"index": i, "function": {"arguments": piece}}]})
    return out
