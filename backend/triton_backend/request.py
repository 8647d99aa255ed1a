"""Parse one Triton request of the `tritium` backend into engine inputs (see contract.py).

Each batch row becomes a ParsedRequest: the prompt (text or ids), SamplingParams keyword
arguments, and the stream / echo / logprob flags. Bad input raises RequestError naming the Triton
input (or the `sampling_parameters` key) and the allowed values. Pure numpy, so it is unit-tested
without a server.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy as np

from tritium.backend.chat_template import normalize_messages
from tritium.backend.errors import RequestError
from tritium.backend.guided import surfaces as guided_surfaces
from tritium.backend.request_fields import wire_text
from tritium.backend.sampling_params import FIELD, FIELDS, SamplingParams
from tritium.backend.triton_backend.contract import INPUTS

# Room for every key with 32 stop strings and 256 bad words at their longest, JSON-escaped.
MAX_SAMPLING_PARAMETERS_CHARS = 1 << 20
MAX_MESSAGES_CHARS = 16 << 20

# The request fields each surface spells its own way, from the one schema (sampling_params.py).
_BY_JSON_KEY = {f.json_key: f for f in FIELDS if f.json_key}
_BY_TENSOR = {f.tensor: f for f in FIELDS if f.tensor}


@dataclass
class ParsedRequest:
    """One batch row, ready for the engine."""
    prompt: Optional[str]                 # text prompt, or None when prompt_token_ids / messages is given
    prompt_token_ids: Optional[List[int]]
    params: Dict[str, object] = field(default_factory=dict)  # SamplingParams keyword arguments it gave
    sampling: Optional[SamplingParams] = None  # built (so checked) from params
    stream: bool = False
    exclude_input_in_output: bool = True
    return_log_probs: bool = False
    messages: Optional[List[dict]] = None  # chat messages, for the engine's chat template
    tools: Optional[List[dict]] = None     # OpenAI tools, for the chat template (with messages)
    lora_name: Optional[str] = None        # sampling.lora_name (vllm_backend's sampling_parameters key)
    lora_task_id: Optional[int] = None     # sampling.lora_task_id (tensorrtllm_backend's tensor)
    lora_tensors: Optional[Tuple[np.ndarray, np.ndarray]] = None  # (lora_weights, lora_config) sent with it


def batch_size_of(arrays: Dict[str, np.ndarray]) -> int:
    """Largest leading dimension among the inputs (inputs with batch 1 broadcast)."""
    sizes = [a.shape[0] for a in arrays.values() if a.ndim >= 1]
    return max(sizes) if sizes else 1


def _row(arrays: Dict[str, np.ndarray], name: str, row: int, batch: int) -> Optional[np.ndarray]:
    a = arrays.get(name)
    if a is None:
        return None
    if a.ndim == 0:
        a = a.reshape(1, 1)
    if a.shape[0] not in (1, batch):
        raise RequestError(f"{name} has batch dimension {a.shape[0]}, but the request batch is {batch}; "
                           f"give 1 or {batch} rows", field=name)
    return a[row if a.shape[0] > 1 else 0]


def _flag(name: str, a: np.ndarray) -> bool:
    """A TYPE_BOOL option input (stream, exclude_input_in_output, return_log_probs)."""
    flat = np.asarray(a).reshape(-1)
    if flat.size != 1:
        raise RequestError(f"{name} must hold exactly one value per batch row, got {flat.size}", field=name)
    if flat.dtype != np.bool_:
        raise RequestError(f"{name} must be TYPE_BOOL, got {flat.dtype}", field=name)
    return bool(flat[0])


def _token_id(name: str, a: np.ndarray, vocab_size: Optional[int]) -> int:
    flat = np.asarray(a).reshape(-1)
    if flat.size != 1 or flat.dtype.kind not in "iu":
        raise RequestError(f"{name} must be one integer per batch row, got {flat.size} of {flat.dtype}", field=name)
    v = int(flat[0])
    if v < 0 or (vocab_size is not None and v >= vocab_size):
        raise RequestError(f"{name} must be a token id in [0, {vocab_size}), got {v}", field=name)
    return v


def parse_sampling_parameters(text: str) -> Dict[str, object]:
    """vllm_backend's `sampling_parameters` JSON -> SamplingParams kwargs; unknown keys are errors."""
    if len(text) > MAX_SAMPLING_PARAMETERS_CHARS:
        raise RequestError(f"sampling_parameters has {len(text)} characters; at most "
                           f"{MAX_SAMPLING_PARAMETERS_CHARS} are allowed", field="sampling_parameters")
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise RequestError(f"sampling_parameters must be a JSON object ({e.msg} at char {e.pos})",
                           field="sampling_parameters") from None
    except RecursionError:  # json recurses per nesting level: "[" * 5000
        raise RequestError("sampling_parameters must be a JSON object (nested too deeply)",
                           field="sampling_parameters") from None
    except ValueError as e:  # e.g. an integer literal over Python's 4300-digit limit
        raise RequestError(f"sampling_parameters must be a JSON object ({e})", field="sampling_parameters") from None
    if not isinstance(d, dict):
        raise RequestError("sampling_parameters must be a JSON object", field="sampling_parameters")
    out: Dict[str, object] = {}
    try:
        guided = guided_surfaces.from_vllm(d)  # pops structured_outputs / guided_* keys
    except RequestError:
        raise
    except ValueError as e:
        raise RequestError(str(e), field="guided") from None
    if guided is not None:
        out["guided"] = guided
    for key, v in d.items():
        f = _BY_JSON_KEY.get(key)
        if f is None:
            allowed = sorted(set(_BY_JSON_KEY) | set(guided_surfaces.VLLM_KEYS))
            raise RequestError(f"sampling_parameters: unknown key {key!r}; allowed: {', '.join(allowed)}", field=key)
        out[f.name] = f.from_json(v, f"sampling_parameters.{key}")
    return out


def parse_messages(text: str) -> List[dict]:
    """The `messages` input: a JSON list of {role, content} objects (checked by chat_template)."""
    if len(text) > MAX_MESSAGES_CHARS:
        raise RequestError(f"messages has {len(text)} characters; at most {MAX_MESSAGES_CHARS} are allowed",
                           field="messages")
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise RequestError(f"messages must be a JSON list ({e.msg} at char {e.pos})", field="messages") from None
    except (RecursionError, ValueError):
        raise RequestError("messages must be a JSON list of {role, content} objects", field="messages") from None
    return normalize_messages(d)


def parse_row(arrays: Dict[str, np.ndarray], row: int, batch: int, vocab_size: Optional[int] = None) -> ParsedRequest:
    """Turn one batch row of a request's input arrays into a ParsedRequest.

    Raises RequestError naming the field. The limits that depend on the engine (max_tokens vs
    max_seq_len) are checked at admission (SamplingParams.check_context).
    """
    known = {s.name for s in INPUTS}
    for name in arrays:
        if name not in known:
            raise RequestError(f"unknown input {name!r}; allowed: {', '.join(sorted(known))}", field=name)
    params = _sampling_params(arrays, row, batch)
    _add_stop_ids(params, arrays, row, batch, vocab_size)
    _add_guide(params, arrays, row, batch)
    flags = {}
    for tname in ("stream", "exclude_input_in_output", "return_log_probs", "return_num_input_tokens",
                  "return_num_output_tokens"):
        a = _row(arrays, tname, row, batch)
        flags[tname] = None if a is None else _flag(tname, a)
    return_log_probs = bool(flags["return_log_probs"]) or params.get("logprobs") is not None
    if return_log_probs and params.get("logprobs") is None:
        params["logprobs"] = 0
    sampling = _build(params, arrays)
    messages = _messages(arrays, row, batch)
    tools = _tools(arrays, row, batch, messages)
    prompt, prompt_ids = (None, None) if messages is not None else _prompt(arrays, row, batch, vocab_size)
    lora_tensors = _lora_tensors(sampling, arrays, row, batch)
    return ParsedRequest(
        prompt=prompt, prompt_token_ids=prompt_ids, params=params, sampling=sampling, messages=messages, tools=tools,
        lora_name=sampling.lora_name, lora_task_id=sampling.lora_task_id, lora_tensors=lora_tensors,
        stream=bool(flags["stream"]),
        exclude_input_in_output=True if flags["exclude_input_in_output"] is None else flags["exclude_input_in_output"],
        return_log_probs=return_log_probs)


def _lora_tensors(sampling: SamplingParams, arrays: Dict[str, np.ndarray], row: int, batch: int):
    """(lora_weights, lora_config) sent with this row's lora_task_id, or None. The adapter's name
    and id are request fields (SamplingParams checked them); this checks what comes with them."""
    w, c = _row(arrays, "lora_weights", row, batch), _row(arrays, "lora_config", row, batch)
    if (w is None) != (c is None):
        raise RequestError("lora_weights and lora_config come together (with lora_task_id)",
                           field="lora_weights" if w is None else "lora_config")
    if w is not None and sampling.lora_task_id is None:
        raise RequestError("lora_weights / lora_config need lora_task_id: the id they are cached under",
                           field="lora_task_id")
    if sampling.lora_name is not None and sampling.lora_task_id is not None:
        raise RequestError("give one of sampling_parameters.lora_name and lora_task_id", field="lora_name")
    return None if w is None else (np.asarray(w), np.asarray(c))


def _messages(arrays: Dict[str, np.ndarray], row: int, batch: int) -> Optional[List[dict]]:
    """The chat `messages` of this row (None without them); they replace text_input / input_ids."""
    m = _row(arrays, "messages", row, batch)
    if m is None:
        return None
    if _row(arrays, "text_input", row, batch) is not None or _row(arrays, "input_ids", row, batch) is not None:
        raise RequestError("give one of text_input, input_ids and messages", field="messages")
    flat = np.asarray(m).reshape(-1)
    if flat.size != 1:
        raise RequestError(f"messages must hold exactly one JSON string per batch row, got {flat.size}",
                           field="messages")
    return parse_messages(wire_text("messages", flat[0]))


def _tools(arrays: Dict[str, np.ndarray], row: int, batch: int, messages) -> Optional[List[dict]]:
    """The `tools` input: a JSON list of objects, only with messages (the chat template renders it)."""
    t = _row(arrays, "tools", row, batch)
    if t is None:
        return None
    if messages is None:
        raise RequestError("tools needs messages (the chat template renders them)", field="tools")
    text = wire_text("tools", np.asarray(t).reshape(-1)[0])
    if len(text) > MAX_MESSAGES_CHARS:
        raise RequestError(f"tools has {len(text)} characters; at most {MAX_MESSAGES_CHARS} are allowed", field="tools")
    try:
        v = json.loads(text)
    except (ValueError, RecursionError):
        raise RequestError("tools must be a JSON list of tool objects", field="tools") from None
    if not isinstance(v, list) or not all(isinstance(x, dict) for x in v):
        raise RequestError("tools must be a JSON list of tool objects", field="tools")
    return v or None


def _add_guide(params: dict, arrays: Dict[str, np.ndarray], row: int, batch: int) -> None:
    """guided_decoding_guide_type / guided_decoding_guide (they win over sampling_parameters')."""
    texts = {}
    for tname in (guided_surfaces.TYPE_TENSOR, guided_surfaces.GUIDE_TENSOR):
        a = _row(arrays, tname, row, batch)
        if a is not None:
            flat = np.asarray(a).reshape(-1)
            if flat.size != 1:
                raise RequestError(f"{tname} must hold exactly one string per batch row, got {flat.size}",
                                   field="guided")
            texts[tname] = wire_text(tname, flat[0], "guided")
    try:
        g = guided_surfaces.from_tensors(texts.get(guided_surfaces.TYPE_TENSOR),
                                         texts.get(guided_surfaces.GUIDE_TENSOR))
    except ValueError as e:
        raise RequestError(str(e), field="guided") from None
    if g is not None:
        params["guided"] = g


def _build(params: Dict[str, object], arrays: Dict[str, np.ndarray]) -> SamplingParams:
    """SamplingParams from the row's kwargs (this checks every field). An error about a field
    that came in a tensor of another name says that name too (num_return_sequences for n)."""
    try:
        return SamplingParams(**params)
    except RequestError as e:
        f = FIELD.get(e.field)
        if f is not None and f.tensor and f.tensor != f.name and f.tensor in arrays:
            raise RequestError(f"{f.tensor}: {e.message}", field=e.field, code=e.code) from None
        raise


def _sampling_params(arrays: Dict[str, np.ndarray], row: int, batch: int) -> Dict[str, object]:
    """SamplingParams kwargs from `sampling_parameters` JSON, then the field tensors: scalars
    override the JSON, word lists (stop_words, bad_words) are appended to it."""
    params: Dict[str, object] = {}
    sp = _row(arrays, "sampling_parameters", row, batch)
    if sp is not None:
        params.update(parse_sampling_parameters(wire_text("sampling_parameters", np.asarray(sp).reshape(-1)[0])))
    for tname, f in _BY_TENSOR.items():
        a = _row(arrays, tname, row, batch)
        if a is None:
            continue
        v = f.from_tensor(a, tname)
        if f.kind == "words":  # appended to the JSON's list (normalized by the schema: a string is a list of one)
            v = (f.check(params[f.name]) if f.name in params else []) + v
        params[f.name] = v
    params.setdefault("max_tokens", FIELD["max_tokens"].default)
    return params


def _add_stop_ids(params: dict, arrays: Dict[str, np.ndarray], row: int, batch: int,
                  vocab_size: Optional[int]) -> None:
    """end_id joins stop_token_ids; end_id and pad_id must be token ids."""
    stop_ids = list(params.get("stop_token_ids") or [])
    for tname in ("end_id", "pad_id"):
        a = _row(arrays, tname, row, batch)
        if a is None:
            continue
        v = _token_id(tname, a, vocab_size)
        if tname == "end_id":
            stop_ids.append(v)
    if stop_ids:
        params["stop_token_ids"] = stop_ids


def _prompt(arrays: Dict[str, np.ndarray], row: int, batch: int,
            vocab_size: Optional[int]) -> Tuple[Optional[str], Optional[List[int]]]:
    """(text prompt, None) from text_input, or (None, ids) from input_ids cut to input_lengths."""
    t = _row(arrays, "text_input", row, batch)
    if t is not None:
        flat = np.asarray(t).reshape(-1)
        if flat.size != 1:
            raise RequestError(f"text_input must hold exactly one string per batch row, got {flat.size}",
                               field="prompt")
        prompt = wire_text("text_input", flat[0])
        if not prompt:
            raise RequestError("text_input must not be empty", field="prompt")
        return prompt, None
    ids = _row(arrays, "input_ids", row, batch)
    if ids is None:
        raise RequestError("text_input is required (or input_ids, or messages)", field="prompt")
    ids = np.asarray(ids).reshape(-1)
    if ids.dtype.kind not in "iu":
        raise RequestError(f"input_ids must be an integer tensor, got {ids.dtype}", field="prompt")
    lens = _row(arrays, "input_lengths", row, batch)
    if lens is not None:
        n = _token_id("input_lengths", lens, None)
        if not 0 <= n <= ids.size:
            raise RequestError(f"input_lengths must be in [0, {ids.size}], got {n}", field="prompt")
        ids = ids[:n]
    prompt_ids = [int(i) for i in ids]
    if not prompt_ids:
        raise RequestError("input_ids must not be empty", field="prompt")
    bad = [i for i in prompt_ids if i < 0 or (vocab_size is not None and i >= vocab_size)]
    if bad:
        raise RequestError(f"input_ids entry {bad[0]} is outside [0, {vocab_size})", field="prompt")
    return None, prompt_ids


def error_prefix(batch: int, row: int) -> str:
    """Prefix naming the row in an error for a batch > 1 request."""
    return f"batch row {row}: " if batch > 1 else ""
