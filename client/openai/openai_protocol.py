"""OpenAI API requests -> the Tritium tensor contract; errors in OpenAI's JSON shape.

Pure Python (no server, no FastAPI): parse_completion_request / parse_chat_request read every
request field whose schema entry (backend/sampling_params.py) has an OpenAI name, build a
SamplingParams from them (which checks them: one range per field, for every surface), and raise
OpenAIError(400, ..., param=NAME) naming the first bad one. A parsed request holds one Triton
request per prompt (the `requests` list: build_request() keyword dicts of
tritium.client.triton_client), and what the answer needs (n, stream, logprobs, echo).

Supported: the schema's fields (max_tokens / max_completion_tokens, temperature, top_p, n, seed,
stop, presence_penalty, frequency_penalty, logit_bias, and vLLM's extensions top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, stop_token_ids, bad_words), logprobs (+ top_logprobs
for chat), echo (completions), stream + stream_options.include_usage. Errors of the backend come
back as codes (backend/errors.py); error_from_code maps them to HTTP statuses. Ignored, as the API allows: user,
metadata, store, service_tier, parallel_tool_calls, and keys this server does not know.
Refused with a 400 naming them: tools / functions (no tool calling), response_format other
than text, best_of other than n, suffix.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from tritium.backend.chat_template import normalize_messages
from tritium.backend.errors import RequestError, TritiumError
from tritium.backend.guided.surfaces import from_response_format
from tritium.backend.sampling_params import FIELD, FIELDS, MAX_LOGPROBS, SamplingParams
from tritium.client.openai.openai_tools import ToolError, ToolRequest, call_guide, parse_tools

MAX_COMPLETION_LOGPROBS = 5          # OpenAI's limit for /v1/completions `logprobs`
MAX_PROMPTS = 64                     # prompts in one /v1/completions request
MAX_CHOICES = 256                    # prompts x n in one request (each is an engine sequence)


class OpenAIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with HTTP `status`."""

    TYPES = {400: "invalid_request_error", 404: "not_found_error", 413: "invalid_request_error",
             499: "request_cancelled", 500: "internal_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


def bad(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, message, param=param, code="invalid_parameter")


@dataclass
class ParsedRequest:
    """One OpenAI request, ready for Triton."""
    kind: str                              # "completion" or "chat"
    model: str
    requests: List[dict]                   # one build_request() kwargs dict per prompt
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    logprobs: Optional[int] = None         # top-N per token (0: only the sampled token); None: off
    echo_prompts: List[Optional[str]] = field(default_factory=list)  # completions echo: prompt text per prompt
    tools: Optional[ToolRequest] = None    # chat with tools (tool_choice not none)


# ---- parameter checks --------------------------------------------------------------------
def _integer(body: dict, name: str, lo: int, hi: Optional[int] = None, default=None):
    """An OpenAI-only integer (completions logprobs, top_logprobs): not a request field."""
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(name, f"{name} must be an integer, got {v!r}")
    if v < lo or (hi is not None and v > hi):
        raise bad(name, f"{name} must be in [{lo}, {hi}], got {v}")
    return v


def _boolean(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(name, f"{name} must be true or false, got {v!r}")
    return v


def openai_param(field: Optional[str], kind: str, max_tokens_name: str = "max_tokens") -> Optional[str]:
    """The OpenAI parameter name of a request field (an error's `field`), by schema lookup."""
    if field == "max_tokens":
        return max_tokens_name
    if field == "logprobs":
        return "top_logprobs" if kind == "chat" else "logprobs"
    if field == "prompt" and kind == "chat":
        return "messages"
    if field == "guided":  # structured outputs arrive as response_format (or a forced tool call)
        return "response_format"
    f = FIELD.get(field)
    return (f.openai or field) if f is not None else field


def _sampling(body: dict, kind: str, max_tokens_name: str, logprobs: Optional[int]) -> SamplingParams:
    """The schema's fields from the body -> a (checked) SamplingParams; errors name the OpenAI parameter."""
    kw: Dict[str, Any] = {}
    for f in FIELDS:
        name = max_tokens_name if f.name == "max_tokens" else f.openai
        if name is None or body.get(name) is None:
            continue
        if f.kind in ("int", "float") and isinstance(body[name], str):
            raise bad(name, f"{name} must be {'an integer' if f.kind == 'int' else 'a number'}, got {body[name]!r}")
        kw[f.name] = f.from_json(body[name], name)
    if "max_tokens" not in kw and kind == "chat":
        kw["max_tokens"] = None  # chat: up to the end of the context (OpenAI's and vLLM's default)
    if logprobs is not None:
        kw["logprobs"] = logprobs
    try:
        return SamplingParams(**kw)
    except RequestError as e:
        raise bad(openai_param(e.field, kind, max_tokens_name), e.message) from None


def _wire_json(sp: SamplingParams, given: set) -> Dict[str, Any]:
    """vllm_backend `sampling_parameters` JSON of the fields the request gave (and max_tokens)."""
    out = {}
    for f in FIELDS:
        if f.name in given and f.json_key:
            v = getattr(sp, f.name)
            out[f.json_key] = {str(k): b for k, b in v.items()} if f.kind == "bias" and v else v
    return out


def _refuse_unsupported(body: dict, kind: str) -> None:
    for name in ("functions", "function_call"):
        if body.get(name):
            raise bad(name, f"{name} is not supported (the API's older form): use tools and tool_choice")
    if kind == "completion" and (body.get("tools") or body.get("tool_choice")):
        raise bad("tools", "tools are a chat completions parameter")
    if kind == "completion":
        if body.get("suffix"):
            raise bad("suffix", "suffix is not supported by this server")
        best_of = body.get("best_of")
        if best_of is not None and best_of != body.get("n", 1) and best_of != 1:
            raise bad("best_of", "best_of is not supported (it must equal n when given)")
    if body.get("audio") or (body.get("modalities") not in (None, ["text"])):
        raise bad("modalities", "only text output is supported")


def _common(body: dict, kind: str, logprobs: Optional[int]) -> tuple:
    """(model, sampling_parameters dict, n, stream, include_usage) from the shared parameters."""
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", "model is required (a model id from GET /v1/models)")
    _refuse_unsupported(body, kind)
    max_tokens_name = max_tokens_param(body, kind)
    sp = _sampling(body, kind, max_tokens_name, logprobs)
    given = {f.name for f in FIELDS if (max_tokens_name if f.name == "max_tokens" else f.openai) in body
             and body[max_tokens_name if f.name == "max_tokens" else f.openai] is not None}
    given.add("max_tokens")
    wire = _wire_json(sp, given - {"logprobs"})
    _response_format(body, wire)
    stream = _boolean(body, "stream")
    include_usage = False
    so = body.get("stream_options")
    if so is not None:
        if not stream:
            raise bad("stream_options", "stream_options is only allowed when stream is true")
        if not isinstance(so, dict):
            raise bad("stream_options", f"stream_options must be an object, got {so!r}")
        include_usage = _boolean(so, "include_usage")
    return model, wire, sp.n, stream, include_usage


def _response_format(body: dict, sp: dict) -> None:
    """response_format -> sampling_parameters.structured_outputs, checked here (the grammar is
    built, so a schema that does not compile is a 400 naming response_format)."""
    try:
        g = from_response_format(body.get("response_format"))
        if g is not None:
            g.grammar()
    except ValueError as e:
        raise bad("response_format", str(e)) from None
    if g is not None:
        sp["structured_outputs"] = {"json_object": True} if g.kind == "json" else {"json": json.loads(g.guide)}


def _tools(body: dict, sp: dict, tool_format: str) -> Optional[ToolRequest]:
    try:
        tr = parse_tools(body, tool_format)
    except ToolError as e:
        raise bad(e.param, str(e)) from None
    if tr is not None and tr.forced:
        if "structured_outputs" in sp:
            raise bad("response_format", "response_format cannot be combined with a forced tool call "
                                         "(tool_choice required or a named function)")
        sp["structured_outputs"] = {"grammar": call_guide(tr).guide}
    return tr


def max_tokens_param(body: dict, kind: str) -> str:
    """The body's name for max_tokens: chat prefers max_completion_tokens (max_tokens is its old name)."""
    if kind == "chat" and body.get("max_completion_tokens") is not None:
        return "max_completion_tokens"
    return "max_tokens"


def _request(prompt_kw: dict, sp: dict, logprobs: Optional[int]) -> dict:
    sp = dict(sp)
    req = dict(prompt_kw, stream=True)  # Triton always streams; non-streamed answers are joined here
    if logprobs is not None:
        sp["logprobs"] = logprobs
        req["return_log_probs"] = True
    req["sampling_parameters"] = json.dumps(sp)
    return req


def parse_completion_request(body: dict) -> ParsedRequest:
    """POST /v1/completions."""
    lp = _integer(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS) if isinstance(body, dict) else None
    model, sp, n, stream, include_usage = _common(body, "completion", lp)
    echo = _boolean(body, "echo")
    if echo and lp is not None:
        raise bad("echo", "echo with logprobs is not supported (prompt logprobs are not computed)")
    prompt = body.get("prompt")
    if prompt is None:
        raise bad("prompt", "prompt is required")
    # prompt: "text" | ["text", ...] | [id, ...] | [[id, ...], ...]
    if isinstance(prompt, str):
        prompts: List[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(x, int) and not isinstance(x, bool) for x in prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(x, str) for x in prompt):
        prompts = list(prompt)
    elif isinstance(prompt, list) and prompt and all(
            isinstance(x, list) and x and all(isinstance(i, int) and not isinstance(i, bool) for i in x) for x in prompt):
        prompts = list(prompt)
    else:
        raise bad("prompt", "prompt must be a string, a list of strings, a list of token ids or a list of "
                            "token-id lists (none empty)")
    if len(prompts) > MAX_PROMPTS:
        raise bad("prompt", f"prompt holds {len(prompts)} prompts; at most {MAX_PROMPTS} are allowed")
    if len(prompts) * n > MAX_CHOICES:
        raise bad("n", f"{len(prompts)} prompts x n {n} = {len(prompts) * n} choices; at most {MAX_CHOICES} "
                       f"are allowed in one request")
    reqs, echoes = [], []
    for p in prompts:
        if isinstance(p, str):
            if not p:
                raise bad("prompt", "prompt must not be empty")
            reqs.append(_request({"prompt": p}, sp, lp))
            echoes.append(p if echo else None)
        else:
            if any(i < 0 or i > 2 ** 31 - 1 for i in p):  # int32 on the wire: never let an id wrap around
                raise bad("prompt", "prompt token ids must be in [0, 2147483647]")
            reqs.append(_request({"input_ids": p}, sp, lp))
            echoes.append("" if echo else None)  # ids only: the prompt text is not known here
    return ParsedRequest("completion", model, reqs, n=n, stream=stream, include_usage=include_usage,
                         logprobs=lp, echo_prompts=echoes)


def parse_chat_request(body: dict, tool_format: str = "hermes") -> ParsedRequest:
    """POST /v1/chat/completions. tool_format: how the model writes tool calls (openai_tools.FORMATS)."""
    want = _boolean(body, "logprobs") if isinstance(body, dict) else False
    top = _integer(body, "top_logprobs", 0, MAX_LOGPROBS) if isinstance(body, dict) else None
    if top is not None and not want:
        raise bad("top_logprobs", "top_logprobs needs logprobs: true")
    lp = (top or 0) if want else None
    model, sp, n, stream, include_usage = _common(body, "chat", lp)
    tr = _tools(body, sp, tool_format)
    try:
        messages = normalize_messages(body.get("messages"))
    except ValueError as e:
        raise bad("messages", str(e)) from None
    prompt_kw = {"messages": json.dumps(messages, ensure_ascii=False)}
    if tr is not None:  # rendered by the engine's chat template (its `tools` variable)
        prompt_kw["tools"] = json.dumps(tr.tools, ensure_ascii=False)
    req = _request(prompt_kw, sp, lp)
    return ParsedRequest("chat", model, [req], n=n, stream=stream, include_usage=include_usage, logprobs=lp,
                         tools=tr)


# ---- the backend's errors -> OpenAI errors ------------------------------------------------
# HTTP status per error code (backend/errors.py); the message is shown, never read.
STATUS_OF = {"bad_parameter": 400, "too_long": 400, "no_chat_template": 400, "overloaded": 503,
             "unavailable": 503, "internal": 500}
OPENAI_CODE_OF = {"bad_parameter": "invalid_parameter", "too_long": "context_length_exceeded",
                  "no_chat_template": "no_chat_template", "overloaded": "overloaded",
                  "unavailable": "engine_unavailable", "internal": "internal_error"}


def error_from_code(err: TritiumError, kind: str, max_tokens_name: str = "max_tokens") -> OpenAIError:
    """OpenAIError for a backend error (code + field, decoded by errors.from_wire)."""
    param = openai_param(err.field, kind, max_tokens_name) if err.code in ("bad_parameter", "too_long",
                                                                          "no_chat_template") else None
    return OpenAIError(STATUS_OF[err.code], err.message, param=param, code=OPENAI_CODE_OF[err.code])
