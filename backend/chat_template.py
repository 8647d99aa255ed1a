"""Chat templates: an engine's `chat_template` turned into a prompt string, safely.

The template comes from the engine folder, as Hugging Face tokenizers store it: the
`chat_template` key of tokenizer_config.json (a string, or a list of {"name", "template"} of
which "default" is used), else a chat_template.jinja file beside it. Templates are untrusted
input (they ship with downloaded checkpoints), so they render in jinja2's
ImmutableSandboxedEnvironment: no attribute access to Python internals, no mutation of the
arguments. The environment follows transformers' conventions (trim_blocks, lstrip_blocks, the
`loopcontrols` extension, `raise_exception`, `tojson`, `strftime_now`), so templates written for
transformers' `apply_chat_template` render the same here.

Used by the OpenAI-compatible server and by `tritium generate --chat`; it imports nothing from
the client or builder side.
"""
from __future__ import annotations

import datetime
import json
import os
from typing import Any, Dict, List, Optional

from .errors import RequestError

ROLES = ("system", "user", "assistant", "tool", "developer")
MAX_TEMPLATE_CHARS = 1 << 20


class NoChatTemplateError(RequestError):
    """The engine carries no chat template, so chat messages cannot become a prompt."""

    code = "no_chat_template"

    def __init__(self, message: str):
        super().__init__(message, field="messages")


class ChatTemplateError(RequestError):
    """The template failed to render these messages (its own raise_exception, or a bad template)."""

    def __init__(self, message: str):
        super().__init__(message, field="messages")


def _token_text(v) -> str:
    """tokenizer_config.json stores special tokens as a string or as {"content": ...}."""
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else ""


def read_template_source(engine_dir: str) -> Optional[str]:
    """The raw chat template text of an engine folder, or None when it has none."""
    cfg_path = os.path.join(engine_dir, "tokenizer_config.json")
    tpl = None
    if os.path.isfile(cfg_path):
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
        tpl = cfg.get("chat_template") if isinstance(cfg, dict) else None
        if isinstance(tpl, list):  # named templates: [{"name": "default", "template": "..."}, ...]
            named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
            tpl = named.get("default")
    if not isinstance(tpl, str) or not tpl.strip():
        jinja = os.path.join(engine_dir, "chat_template.jinja")
        tpl = None
        if os.path.isfile(jinja):
            with open(jinja, encoding="utf-8") as f:
                tpl = f.read()
    if tpl is not None and len(tpl) > MAX_TEMPLATE_CHARS:
        raise ChatTemplateError(f"chat template of {engine_dir} has {len(tpl)} characters; at most "
                                f"{MAX_TEMPLATE_CHARS} are allowed")
    return tpl if tpl and tpl.strip() else None


def _special_tokens(engine_dir: str) -> Dict[str, str]:
    cfg_path = os.path.join(engine_dir, "tokenizer_config.json")
    if not os.path.isfile(cfg_path):
        return {}
    with open(cfg_path, encoding="utf-8") as f:
        cfg = json.load(f)
    if not isinstance(cfg, dict):
        return {}
    return {k: _token_text(cfg.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}


def _raise_exception(message):
    raise ChatTemplateError(f"the chat template refused these messages: {message}")


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)


def normalize_messages(messages: Any, where: str = "messages") -> List[Dict[str, Any]]:
    """Check OpenAI-style chat messages; text-part lists become one string. ValueError names the field."""
    if not isinstance(messages, list) or not messages:
        raise RequestError(f"{where} must be a non-empty list of {{role, content}} objects", field="messages")
    out = []
    for i, m in enumerate(messages):
        at = f"{where}[{i}]"
        if not isinstance(m, dict):
            raise RequestError(f"{at} must be an object with role and content", field="messages")
        role = m.get("role")
        if role not in ROLES:
            raise RequestError(f"{at}.role must be one of {', '.join(ROLES)}, got {role!r}", field="messages")
        content = m.get("content")
        if content is None:
            content = ""
        if isinstance(content, list):  # [{"type": "text", "text": "..."}]
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise RequestError(f"{at}.content[{j}] must be {{\"type\": \"text\", \"text\": STRING}} "
                                       f"(only text parts are supported)", field="messages")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise RequestError(f"{at}.content must be a string or a list of text parts", field="messages")
        msg = {"role": role, "content": content}
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        if m.get("tool_calls") is not None:  # an assistant turn that called tools
            if not isinstance(m["tool_calls"], list) or not all(isinstance(c, dict) for c in m["tool_calls"]):
                raise ValueError(f"{at}.tool_calls must be a list of tool call objects")
            msg["tool_calls"] = m["tool_calls"]
        if m.get("tool_call_id") is not None:  # a tool's answer
            if not isinstance(m["tool_call_id"], str):
                raise ValueError(f"{at}.tool_call_id must be a string")
            msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
    return out


class ChatTemplate:
    """A compiled chat template with the engine's special tokens.

        tpl = ChatTemplate.from_engine_dir("/path/to/engine")   # NoChatTemplateError if none
        prompt = tpl.render([{"role": "user", "content": "Hi"}])
    """

    def __init__(self, source: str, special_tokens: Optional[Dict[str, str]] = None, name: str = "engine"):
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except TemplateError as e:
            raise ChatTemplateError(f"chat template of {name} does not compile: {e}") from None
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self.name = name

    @classmethod
    def from_engine_dir(cls, engine_dir: str) -> "ChatTemplate":
        src = read_template_source(engine_dir)
        if src is None:
            raise NoChatTemplateError(
                f"engine {engine_dir} has no chat template (no chat_template in tokenizer_config.json, no "
                f"chat_template.jinja); send a plain prompt instead, or add a template to the engine folder")
        return cls(src, _special_tokens(engine_dir), name=engine_dir)

    def render(self, messages: List[Dict[str, Any]], add_generation_prompt: bool = True, **kwargs) -> str:
        """The prompt text for these messages (validated with normalize_messages first)."""
        from jinja2 import TemplateError
        from jinja2.sandbox import SecurityError
        msgs = normalize_messages(messages)
        ctx = dict(self.special_tokens)
        ctx.update(kwargs)
        try:
            return self._template.render(messages=msgs, add_generation_prompt=add_generation_prompt, **ctx)
        except ChatTemplateError:
            raise
        except SecurityError as e:
            raise ChatTemplateError(f"chat template of {self.name} tried an unsafe operation: {e}") from None
        except (TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise ChatTemplateError(f"chat template of {self.name} failed: {type(e).__name__}: {e}") from None
