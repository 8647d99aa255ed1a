"""The error contract: every error a request can meet carries a code and the field it is about.

Codes (what went wrong, so a front end never reads the message to decide):
    bad_parameter     a request field is missing, of the wrong type or out of its range
    too_long          the prompt (or prompt + max_tokens) does not fit the engine's context or KV pool
    no_chat_template  chat messages sent to an engine that carries no chat template
    overloaded        the waiting queue is full; retry later
    unavailable       the engine is dead or shut down; the request was not run
    internal          a bug; the message says what, the field is None

`field` is the request field's schema name (SamplingParams' attribute: "n", not
"num_return_sequences"), "prompt", "messages", or None. Errors cross Triton as a JSON object
{"code", "field", "message"} in the error message (`to_wire` / `from_wire`): structured data, so
the OpenAI layer maps codes to HTTP statuses and fields to its parameter names by lookup.
"""
from __future__ import annotations

import json
from typing import Optional

CODES = ("bad_parameter", "too_long", "no_chat_template", "overloaded", "unavailable", "internal")


class TritiumError(Exception):
    """An error with a code (one of CODES) and the request field it names (or None)."""

    code = "internal"

    def __init__(self, message: str, field: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        if code is not None:
            self.code = code
        assert self.code in CODES, self.code
        self.field = field
        self.message = message


class RequestError(TritiumError, ValueError):
    """Bad user input (a ValueError, so callers that catch ValueError keep working)."""

    code = "bad_parameter"


def error_info(exc: BaseException) -> dict:
    """{"code", "field", "message"} for any exception: a TritiumError keeps its own, a plain
    ValueError is a bad_parameter without a field, anything else is internal."""
    if isinstance(exc, TritiumError):
        return {"code": exc.code, "field": exc.field, "message": exc.message}
    code = "bad_parameter" if isinstance(exc, ValueError) else "internal"
    message = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
    return {"code": code, "field": None, "message": " ".join(message.split())}


def to_wire(exc: BaseException, prefix: str = "") -> str:
    """The error message a Triton response carries: the JSON of error_info (prefix: e.g. the batch row)."""
    info = error_info(exc)
    info["message"] = prefix + info["message"]
    return json.dumps(info, ensure_ascii=False)


def from_wire(text: str) -> TritiumError:
    """The TritiumError a Triton error message stands for. Errors the `tritium` backend did not
    write (tritonserver's own: an unknown model, a bad tensor shape) are `internal` with the
    server's text as the message."""
    text = str(text)
    decoder = json.JSONDecoder()
    start = text.find("{")  # tritonserver may put its own words before the model's message
    while start >= 0:
        try:
            d, _ = decoder.raw_decode(text, start)
        except ValueError:
            d = None
        if isinstance(d, dict) and d.get("code") in CODES and isinstance(d.get("message"), str):
            return TritiumError(d["message"], field=d.get("field"), code=d["code"])
        start = text.find("{", start + 1)
    return TritiumError(" ".join(text.split()), code="internal")
