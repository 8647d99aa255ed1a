"""OpenAI API requests -> the Tritium tensor contract; errors in OpenAI's JSON shape.

Pure Python (no server, no FastAPI): parse_completion_request / parse_chat_request check every
parameter the OpenAI API defines for /v1/completions and /v1/chat/completions, and raise
OpenAIError(400, ..., param=NAME) naming the first bad one. A parsed request holds one Triton
request per prompt (the `requests` list: build_request() keyword dicts of
tritium.client.triton_client), and what the answer needs (n, stream, logprobs, echo).

Supported: max_tokens / max_completion_tokens, temperature, top_p, n, seed, stop,
presence_penalty, frequency_penalty, logprobs (+ top_logprobs for chat), logit_bias, echo
(completions), stream + stream_options.include_usage; response_format (text, json_object,
json_schema: structured outputs, backend/guided/); tools + tool_choice (client/openai_tools.py);
and vLLM's extensions ignore_eos and min_tokens (benchmarks use them to fix output lengths).
Ignored, as the API allows: user, metadata, store, service_tier, parallel_tool_calls, and keys
this server does not know. Refused with a 400 naming them: functions / function_call (use
tools), best_of other than n, suffix, response_format together with a forced tool call.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from tritium.backend.chat_template import normalize_messages
from tritium.backend.guided.surfaces import from_response_format
from tritium.backend.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_N, MAX_NUM_STOP
from tritium.client.openai_tools import ToolError, ToolRequest, call_guide, parse_tools

DEFAULT_COMPLETION_MAX_TOKENS = 16   # the OpenAI completions API's default
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
def _number(body: dict, name: str, lo: float, hi: float, default=None, lo_open: bool = False):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or math.isinf(v):
        raise bad(name, f"{name} must be a number, got {v!r}")
    if (v <= lo if lo_open else v < lo) or v > hi:
        raise bad(name, f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}], got {v!r}")
    return float(v)


def _integer(body: dict, name: str, lo: int, hi: Optional[int] = None, default=None):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        else:
            raise bad(name, f"{name} must be an integer, got {v!r}")
    if v < lo or (hi is not None and v > hi):
        rng = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise bad(name, f"{name} must be {'in ' if hi is not None else ''}{rng}, got {v}")
    return v


def _boolean(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(name, f"{name} must be true or false, got {v!r}")
    return v


def _stop(body: dict) -> List[str]:
    v = body.get("stop")
    if v is None:
        return []
    words = [v] if isinstance(v, str) else v
    if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
        raise bad("stop", f"stop must be a string or a list of strings, got {v!r}")
    words = [w for w in words if w]
    if len(words) > MAX_NUM_STOP:
        raise bad("stop", f"stop has {len(words)} strings; at most {MAX_NUM_STOP} are allowed")
    return words


def _logit_bias(body: dict) -> Optional[Dict[str, float]]:
    v = body.get("logit_bias")
    if v is None:
        return None
    if not isinstance(v, dict):
        raise bad("logit_bias", f"logit_bias must be an object mapping token ids to a bias, got {v!r:.200}")
    if len(v) > MAX_LOGIT_BIAS:
        raise bad("logit_bias", f"logit_bias has {len(v)} entries; at most {MAX_LOGIT_BIAS} are allowed")
    out = {}
    for k, b in v.items():
        try:
            tok = int(k)
        except (TypeError, ValueError):
            raise bad("logit_bias", f"logit_bias keys must be token ids (integers as strings), got {k!r}") from None
        if tok < 0:
            raise bad("logit_bias", f"logit_bias keys must be token ids >= 0, got {k!r}")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or math.isnan(b) or not -100 <= b <= 100:
            raise bad("logit_bias", f"logit_bias values must be numbers in [-100, 100], got {b!r} for {k!r}")
        out[str(tok)] = float(b)
    return out or None


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


def _common(body: dict, kind: str, max_tokens_name: str) -> tuple:
    """(model, sampling_parameters dict, n, stream, include_usage) from the shared parameters."""
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", "model is required (a model id from GET /v1/models)")
    _refuse_unsupported(body, kind)
    sp: Dict[str, Any] = {}
    max_tokens = _integer(body, max_tokens_name, 1)
    if max_tokens_name == "max_completion_tokens" and max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1)
    if max_tokens is None:
        # completions: the API's default of 16; chat: up to the end of the context
        sp["max_tokens"] = DEFAULT_COMPLETION_MAX_TOKENS if kind == "completion" else None
    else:
        sp["max_tokens"] = max_tokens
    t = _number(body, "temperature", 0.0, 2.0)
    if t is not None:
        sp["temperature"] = t
    tp = _number(body, "top_p", 0.0, 1.0, lo_open=True)
    if tp is not None:
        sp["top_p"] = tp
    for name in ("presence_penalty", "frequency_penalty"):
        v = _number(body, name, -2.0, 2.0)
        if v is not None:
            sp[name] = v
    seed = _integer(body, "seed", 0, 2 ** 63 - 1)
    if seed is not None:
        sp["seed"] = seed
    n = _integer(body, "n", 1, MAX_N, default=1)
    if n > 1:
        sp["n"] = n
    stop = _stop(body)
    if stop:
        sp["stop"] = stop
    lb = _logit_bias(body)
    if lb:
        sp["logit_bias"] = lb
    _response_format(body, sp)
    # vLLM's extensions, which benchmarks (aiperf --extra-inputs) use to fix output lengths
    if _boolean(body, "ignore_eos"):
        sp["ignore_eos"] = True
    mt = _integer(body, "min_tokens", 0)
    if mt:
        sp["min_tokens"] = mt
    stream = _boolean(body, "stream")
    include_usage = False
    so = body.get("stream_options")
    if so is not None:
        if not stream:
            raise bad("stream_options", "stream_options is only allowed when stream is true")
        if not isinstance(so, dict):
            raise bad("stream_options", f"stream_options must be an object, got {so!r}")
        include_usage = _boolean(so, "include_usage")
    return model, sp, n, stream, include_usage


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
    model, sp, n, stream, include_usage = _common(body, "completion", "max_tokens")
    lp = _integer(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
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
    model, sp, n, stream, include_usage = _common(body, "chat", "max_completion_tokens")
    tr = _tools(body, sp, tool_format)
    want = _boolean(body, "logprobs")
    top = _integer(body, "top_logprobs", 0, MAX_LOGPROBS)
    if top is not None and not want:
        raise bad("top_logprobs", "top_logprobs needs logprobs: true")
    lp = (top or 0) if want else None
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


# ---- Triton's errors -> OpenAI errors -----------------------------------------------------
# The backend names Triton inputs / SamplingParams fields; map them to the OpenAI parameter.
_PARAM_OF = (
    ("sampling_parameters.", None), ("num_return_sequences", "n"), ("stop (stop_words)", "stop"),
    ("max_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"), ("seed", "seed"),
    ("presence_penalty", "presence_penalty"), ("frequency_penalty", "frequency_penalty"),
    ("logit_bias", "logit_bias"), ("logprobs", "logprobs"), ("n ", "n"), ("stop", "stop"),
    ("prompt", "prompt"), ("text_input", "prompt"), ("input_ids", "prompt"), ("messages", "messages"),
    ("structured_outputs", "response_format"), ("tools", "tools"),
)


def error_from_triton(message: str, kind: str, max_tokens_name: str = "max_tokens") -> OpenAIError:
    """OpenAIError for an error message of the tritium backend (or of tritonserver)."""
    msg = " ".join(str(message).split())
    if "EngineOverloadedError" in msg or "overloaded" in msg.lower():
        return OpenAIError(503, f"the server is overloaded, retry later ({msg})", code="overloaded")
    if "EngineDeadError" in msg or "request failed" in msg:
        return OpenAIError(503, msg, code="engine_unavailable")
    if "has no chat template" in msg:
        return OpenAIError(400, msg, param="messages", code="no_chat_template")
    body = msg.removeprefix("tritium: ").replace("sampling_parameters.", "")
    if body.startswith("batch row"):
        body = body.split(": ", 1)[-1]
    param = None
    for prefix, name in _PARAM_OF:
        if name and body.startswith(prefix):
            param = name
            break
    if param == "prompt" and kind == "chat":
        param = "messages"
    if param == "max_tokens":
        param = max_tokens_name
    return OpenAIError(400, msg, param=param, code="invalid_parameter")
