"""The request-field schema: what a request field is, how each surface spells it, how it is checked.

A field is declared once, as an attribute of SamplingParams (backend/sampling_params.py) whose
default is `request_field(...)`: its kind, default, range or choices, and its name on every
surface. Everything else is derived from that one declaration:

    Triton tensor inputs     contract.INPUTS (tensor=, tensor_type=)    -> triton_backend/request.py
    vllm_backend JSON        `sampling_parameters` keys (json_key=)      -> triton_backend/request.py
    OpenAI API               request body names (openai=)                -> client/openai/openai_protocol.py
    `tritium generate`       flags (cli=)                                -> client/cli/generate_cli.py
    validation               RequestField.check, run by SamplingParams.__post_init__

so each surface only converts wire types (`from_json`, `from_tensor`, argparse) and builds a
SamplingParams, which checks every field once, at that edge; the engine trusts it.

Adding a field (e.g. structured outputs' guided_decoding_guide_type, LoRA's lora_name) is one
entry in SamplingParams:

    guided_decoding_guide_type: Optional[str] = request_field(
        None, "str", choices=("json", "regex", "choice", "grammar"), json_key="guided_decoding_guide_type",
        openai="guided_decoding_guide_type", cli="--guided-decoding-guide-type", doc="...")

Give `tensor=` only for a new Triton input (it then appears in every generated config.pbtxt); a
field with no name for a surface is simply not accepted there. Kinds: "int", "float" (always
finite), "bool", "str" (optional `choices`), "words" (a string or a list of strings; empty
strings are dropped: tensorrtllm_backend pads with them and OpenAI clients send them), "ids"
(token ids, >= 0), "bias" ({token id: number}), "json" (any JSON value, checked by `check_fn`).
Limits that depend on the engine (token ids < vocab size, max_tokens vs the context) are checked
by SamplingParams.check_context at admission.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from .errors import RequestError

KINDS = ("int", "float", "bool", "str", "words", "ids", "bias", "json")
_TENSOR_TYPES = {"int": "TYPE_INT32", "float": "TYPE_FP32", "bool": "TYPE_BOOL", "str": "TYPE_STRING",
                 "words": "TYPE_STRING", "ids": "TYPE_INT32"}
_UNSET = object()
MAX_INT32 = 2 ** 31 - 1  # token ids and counts travel as int32 tensors


@dataclass(frozen=True)
class RequestField:
    """One request field: checks and names. `name` is the SamplingParams attribute (filled in by
    fields_of); errors always name the field by it."""
    kind: str
    default: Any = None
    lo: Optional[float] = None          # range: lo (<|<=) value (<|<=) hi; None = unbounded
    hi: Optional[float] = None
    lo_open: bool = False
    hi_open: bool = False
    choices: Optional[tuple] = None     # "str": the allowed values
    nullable: bool = False              # None is a meaningful value (besides a None default)
    off: tuple = ()                     # wire values read as None ("off"), e.g. top_k 0 / -1
    max_items: Optional[int] = None     # "words" / "ids" / "bias": most entries
    max_chars: Optional[int] = None     # "words" / "str": most characters per string
    check_fn: Optional[Callable[[Any], Any]] = None  # extra check / normalization (raise ValueError)
    tensor: Optional[str] = None        # Triton input name
    tensor_type: Optional[str] = None   # its config.pbtxt type (default by kind)
    json_key: Optional[str] = None      # vllm_backend `sampling_parameters` key
    openai: Optional[str] = None        # OpenAI request body name
    cli: Optional[str] = None           # `tritium generate` flag
    cli_default: Any = _UNSET           # the CLI's default when it differs from `default` (say why in doc)
    doc: str = ""
    name: str = ""

    # ---- what the surfaces need -------------------------------------------------------------
    @property
    def wire_type(self) -> str:
        return self.tensor_type or _TENSOR_TYPES[self.kind]

    @property
    def tensor_dims(self) -> tuple:
        return (-1,) if self.kind in ("words", "ids") else (1,)

    @property
    def default_for_cli(self):
        return self.default if self.cli_default is _UNSET else self.cli_default

    def range_text(self) -> str:
        lo = "-inf" if self.lo is None else _num(self.lo)
        hi = "inf" if self.hi is None else _num(self.hi)
        left = "(" if self.lo_open or self.lo is None else "["
        right = ")" if self.hi_open or self.hi is None else "]"
        return f"{left}{lo}, {hi}{right}"

    def error(self, message: str) -> RequestError:
        return RequestError(message, field=self.name)

    # ---- checking (SamplingParams.__post_init__) --------------------------------------------
    def check(self, value):
        """The value, normalized (off values -> None, a stop string -> [it], ...); raises
        RequestError naming this field and the allowed values."""
        if value is None or (self.off and not isinstance(value, bool) and value in self.off):
            if value is None and not (self.nullable or self.default is None or self.off):
                raise self.error(f"{self.name} must not be null")
            return None
        v = getattr(self, f"_check_{self.kind}")(value)
        return self.check_fn(v) if self.check_fn is not None else v

    def _in_range(self, v) -> None:
        if (self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo)) or \
                (self.hi is not None and (v >= self.hi if self.hi_open else v > self.hi)):
            extra = f", or {' / '.join(map(repr, self.off))} or null for off" if self.off else ""
            raise self.error(f"{self.name} must be in {self.range_text()}{extra}, got {_show(v)}")

    def _check_int(self, v):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise self.error(f"{self.name} must be an integer, got {_show(v)}")
        self._in_range(int(v))
        return int(v)

    def _check_float(self, v):
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) \
                or not math.isfinite(v):
            raise self.error(f"{self.name} must be a finite number, got {_show(v)}")
        self._in_range(float(v))
        return float(v)

    def _check_bool(self, v):
        if not isinstance(v, (bool, np.bool_)):
            raise self.error(f"{self.name} must be true or false, got {_show(v)}")
        return bool(v)

    def _check_str(self, v):
        if not isinstance(v, str):
            raise self.error(f"{self.name} must be a string, got {_show(v)}")
        if self.choices is not None and v not in self.choices:
            raise self.error(f"{self.name} must be one of {', '.join(self.choices)}, got {_show(v)}")
        if self.max_chars is not None and len(v) > self.max_chars:
            raise self.error(f"{self.name} must have at most {self.max_chars} characters, got {len(v)}")
        return v

    def _check_words(self, v):
        words = [v] if isinstance(v, str) else v
        if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) for w in words):
            raise self.error(f"{self.name} must be a string or a list of strings, got {_show(v)}")
        words = [w for w in words if w]
        self._check_count(len(words))
        for w in words:
            if self.max_chars is not None and len(w) > self.max_chars:
                raise self.error(f"{self.name} entries must have at most {self.max_chars} characters, "
                                 f"got one of {len(w)}")
        return words

    def _check_ids(self, v):
        if not isinstance(v, (list, tuple)):
            raise self.error(f"{self.name} must be a list of token ids, got {_show(v)}")
        self._check_count(len(v))
        for t in v:
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t <= MAX_INT32:
                raise self.error(f"{self.name} entries must be token ids (integers in [0, {MAX_INT32}]), "
                                 f"got {_show(t)}")
        return [int(t) for t in v]

    def _check_bias(self, v):
        if not isinstance(v, dict):
            raise self.error(f"{self.name} must be an object {{token id: bias}}, got {_show(v)}")
        self._check_count(len(v))
        out = {}
        for k, b in v.items():
            try:
                tok = int(k)
            except (TypeError, ValueError):
                tok = -1
            if isinstance(k, bool) or not 0 <= tok <= MAX_INT32 or isinstance(k, float):
                raise self.error(f"{self.name} keys must be token ids (integers in [0, {MAX_INT32}]), got {_show(k)}")
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b) or \
                    (self.lo is not None and b < self.lo) or (self.hi is not None and b > self.hi):
                raise self.error(f"{self.name} values must be numbers in {self.range_text()}, "
                                 f"got {_show(b)} for {_show(k)}")
            out[tok] = float(b)
        return out

    def _check_json(self, v):
        return v

    def _check_count(self, n: int) -> None:
        if self.max_items is not None and n > self.max_items:
            raise self.error(f"{self.name} has {n} entries; at most {self.max_items} are allowed")

    # ---- wire conversions (types only; ranges are check()'s) --------------------------------
    def from_json(self, v, where: str):
        """A JSON value -> the field's Python type. vllm_backend sends numbers and booleans as
        strings ("0.7", "true"); both forms are accepted. `where` names the key in errors."""
        if v is None:
            return None
        if self.kind == "bool" and isinstance(v, str) and v.lower() in ("true", "false"):
            return v.lower() == "true"
        if self.kind in ("int", "float") and isinstance(v, str):
            try:
                f = float(v)
            except ValueError:
                raise self.error(f"{where} must be {'an integer' if self.kind == 'int' else 'a number'}, "
                                 f"got {_show(v)}") from None
            v = f
        if self.kind == "int" and isinstance(v, float) and v.is_integer():
            return int(v)
        return v

    def from_tensor(self, a: np.ndarray, where: str):
        """One batch row of a Triton input -> the field's Python type."""
        flat = np.asarray(a).reshape(-1)
        if self.kind in ("words", "str"):
            vals = [wire_text(where, w, self.name) for w in flat]
            if self.kind == "words":
                return vals
            if len(vals) != 1:
                raise self.error(f"{where} must hold exactly one string per batch row, got {len(vals)}")
            return vals[0]
        if self.kind == "ids":
            if flat.dtype.kind not in "iu":
                raise self.error(f"{where} must be an integer tensor, got {flat.dtype}")
            return [int(x) for x in flat]
        if flat.size != 1:
            raise self.error(f"{where} must hold exactly one value per batch row, got {flat.size}")
        v = flat[0]
        want = {"int": "iu", "float": "f", "bool": "b"}[self.kind]
        if flat.dtype.kind not in want:
            raise self.error(f"{where} must be a {self.wire_type} tensor, got {flat.dtype}")
        return {"int": int, "float": float, "bool": bool}[self.kind](v)

    def cli_type(self):
        """argparse type for this field's flag ("words" / "ids" are repeatable, "bias" is JSON)."""
        return {"int": int, "float": float, "str": str, "words": str, "ids": int}.get(self.kind)


def request_field(default, kind: str, **kw):
    """A dataclass field of SamplingParams declaring a request field (see the module docstring)."""
    assert kind in KINDS, kind
    spec = RequestField(kind, default, **kw)
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata={"request": spec})
    return dataclasses.field(default=default, metadata={"request": spec})


def fields_of(cls) -> tuple:
    """The RequestFields of a dataclass declared with request_field(), in declaration order."""
    return tuple(dataclasses.replace(f.metadata["request"], name=f.name)
                 for f in dataclasses.fields(cls) if "request" in f.metadata)


def _show(v) -> str:
    """repr(v) for an error message, cut to 200 characters (a hostile value must not fill the reply)."""
    try:
        r = repr(v)
    except ValueError:  # an int beyond Python's 4,300-digit str() limit
        return "an integer of more than 4300 digits"
    return r if len(r) <= 200 else r[:200] + "..."


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else repr(x)


def wire_text(name: str, v, field: Optional[str] = None) -> str:
    """A TYPE_STRING element as text; errors name the input `name` and report `field` (default: name)."""
    if isinstance(v, (bytes, np.bytes_)):
        try:
            return bytes(v).decode("utf-8")
        except UnicodeDecodeError:
            raise RequestError(f"{name} must be UTF-8 text", field=field or name) from None
    if isinstance(v, str):
        return v
    raise RequestError(f"{name} must be TYPE_STRING (bytes), got {type(v).__name__}", field=field or name)
