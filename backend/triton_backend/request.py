"""Parse one Triton request of the `tritium` backend into engine inputs (see contract.py).

Each batch row becomes a ParsedRequest: the prompt (text or ids), SamplingParams keyword
arguments, and the stream / echo / logprob flags. Bad input raises ValueError naming the Triton
input (or the `sampling_parameters` key) and the allowed values. Pure numpy, so it is unit-tested
without a server.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy as np

from tritium.backend.chat_template import normalize_messages
from tritium.backend.guided import surfaces as guided_surfaces
from tritium.backend.triton_backend.contract import INPUTS

DEFAULT_MAX_TOKENS = 16
# Room for every key with 32 stop strings and 256 bad words at their longest, JSON-escaped.
MAX_SAMPLING_PARAMETERS_CHARS = 1 << 20
MAX_MESSAGES_CHARS = 16 << 20

# vllm_backend's `sampling_parameters` keys we honour, mapped to SamplingParams fields.
_JSON_KEYS = {
    "max_tokens": ("max_tokens", int), "temperature": ("temperature", float), "top_k": ("top_k", int),
    "top_p": ("top_p", float), "min_p": ("min_p", float), "seed": ("seed", int),
    "repetition_penalty": ("repetition_penalty", float), "presence_penalty": ("presence_penalty", float),
    "frequency_penalty": ("frequency_penalty", float), "min_tokens": ("min_tokens", int),
    "n": ("n", int), "stop": ("stop", list), "stop_token_ids": ("stop_token_ids", list),
    "bad_words": ("bad_words", list), "ignore_eos": ("ignore_eos", bool), "logprobs": ("logprobs", int),
    "logit_bias": ("logit_bias", dict),
}
# Scalar tensors -> (SamplingParams field, python type).
_TENSOR_PARAMS = {
    "max_tokens": ("max_tokens", int), "temperature": ("temperature", float), "top_k": ("top_k", int),
    "top_p": ("top_p", float), "min_p": ("min_p", float), "seed": ("seed", int),
    "repetition_penalty": ("repetition_penalty", float), "presence_penalty": ("presence_penalty", float),
    "frequency_penalty": ("frequency_penalty", float), "min_tokens": ("min_tokens", int),
    "num_return_sequences": ("n", int),
}


@dataclass
class ParsedRequest:
    """One batch row, ready for the engine."""
    prompt: Optional[str]                 # text prompt, or None when prompt_token_ids / messages is given
    prompt_token_ids: Optional[List[int]]
    params: Dict[str, object] = field(default_factory=dict)  # SamplingParams keyword arguments
    stream: bool = False
    exclude_input_in_output: bool = True
    return_log_probs: bool = False
    messages: Optional[List[dict]] = None  # chat messages, for the engine's chat template
    tools: Optional[List[dict]] = None     # OpenAI tools, for the chat template (with messages)
    lora_name: Optional[str] = None        # sampling_parameters.lora_name (vllm_backend)
    lora_task_id: Optional[int] = None     # tensorrtllm_backend's adapter id
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
        raise ValueError(f"{name} has batch dimension {a.shape[0]}, but the request batch is {batch}; "
                         f"give 1 or {batch} rows")
    return a[row if a.shape[0] > 1 else 0]


def _scalar(name: str, a: np.ndarray, kind: type):
    flat = np.asarray(a).reshape(-1)
    if flat.size != 1:
        raise ValueError(f"{name} must hold exactly one value per batch row, got {flat.size}")
    v = flat[0]
    if kind is bool:
        if flat.dtype != np.bool_:
            raise ValueError(f"{name} must be TYPE_BOOL, got {flat.dtype}")
        return bool(v)
    if kind is int:
        if flat.dtype.kind not in "iu":
            raise ValueError(f"{name} must be an integer tensor, got {flat.dtype}")
        return int(v)
    if flat.dtype.kind != "f":
        raise ValueError(f"{name} must be a float tensor (TYPE_FP32), got {flat.dtype}")
    return float(v)


def _text(name: str, v) -> str:
    if isinstance(v, (bytes, np.bytes_)):
        try:
            return bytes(v).decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{name} must be UTF-8 text") from None
    if isinstance(v, str):
        return v
    raise ValueError(f"{name} must be TYPE_STRING (bytes), got {type(v).__name__}")


def _convert_json(key: str, kind: type, v):
    """vllm_backend sends numbers as strings ("0.7"); accept both, reject anything else by name."""
    where = f"sampling_parameters.{key}"
    if kind is dict:
        if not isinstance(v, dict):
            raise ValueError(f"{where} must be an object, got {v!r}")
        return v
    if kind is list:
        if key == "stop" and isinstance(v, str):
            return [v]
        if not isinstance(v, list):
            raise ValueError(f"{where} must be a list, got {v!r}")
        return v
    if kind is bool:
        if isinstance(v, bool):
            return v
        if isinstance(v, str) and v.lower() in ("true", "false"):
            return v.lower() == "true"
        raise ValueError(f"{where} must be true or false, got {v!r}")
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise ValueError(f"{where} must be a number, got {v!r}")
    try:
        if kind is int:
            f = float(v)
            if not f.is_integer():
                raise ValueError
            return int(f)
        return float(v)
    except (TypeError, ValueError):
        raise ValueError(f"{where} must be {'an integer' if kind is int else 'a number'}, got {v!r}") from None


def parse_sampling_parameters(text: str) -> Dict[str, object]:
    """vllm_backend's `sampling_parameters` JSON -> SamplingParams kwargs; unknown keys are errors."""
    if len(text) > MAX_SAMPLING_PARAMETERS_CHARS:
        raise ValueError(f"sampling_parameters has {len(text)} characters; at most "
                         f"{MAX_SAMPLING_PARAMETERS_CHARS} are allowed")
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"sampling_parameters must be a JSON object ({e.msg} at char {e.pos})") from None
    except RecursionError:  # json recurses per nesting level: "[" * 5000
        raise ValueError("sampling_parameters must be a JSON object (nested too deeply)") from None
    except ValueError as e:  # e.g. an integer literal over Python's 4300-digit limit
        raise ValueError(f"sampling_parameters must be a JSON object ({e})") from None
    if not isinstance(d, dict):
        raise ValueError("sampling_parameters must be a JSON object")
    out: Dict[str, object] = {}
    guided = guided_surfaces.from_vllm(d)  # pops structured_outputs / guided_* keys
    if guided is not None:
        out["guided"] = guided
    for key, v in d.items():
        if key == "lora_name":  # not a SamplingParams field: parse_row moves it to ParsedRequest
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"sampling_parameters.lora_name must be an adapter name (a string), got {v!r}")
            out["lora_name"] = v
            continue
        if key not in _JSON_KEYS:
            allowed = sorted(set(_JSON_KEYS) | set(guided_surfaces.VLLM_KEYS) | {"lora_name"})
            raise ValueError(f"sampling_parameters: unknown key {key!r}; allowed: {', '.join(allowed)}")
        fname, kind = _JSON_KEYS[key]
        if key == "max_tokens" and v is None:  # null: up to the end of the context (set once the prompt is known)
            out[fname] = None
            continue
        out[fname] = _convert_json(key, kind, v)
    return out


def parse_messages(text: str) -> List[dict]:
    """The `messages` input: a JSON list of {role, content} objects (checked by chat_template)."""
    if len(text) > MAX_MESSAGES_CHARS:
        raise ValueError(f"messages has {len(text)} characters; at most {MAX_MESSAGES_CHARS} are allowed")
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"messages must be a JSON list ({e.msg} at char {e.pos})") from None
    except (RecursionError, ValueError):
        raise ValueError("messages must be a JSON list of {role, content} objects") from None
    return normalize_messages(d)


def _check_finite(name: str, v: float) -> None:
    if math.isnan(v) or math.isinf(v):
        raise ValueError(f"{name} must be a finite number, got {v}")


def parse_row(arrays: Dict[str, np.ndarray], row: int, batch: int, vocab_size: Optional[int] = None) -> ParsedRequest:
    """Turn one batch row of a request's input arrays into a ParsedRequest.

    Raises ValueError naming the offending input. Ranges that depend on the prompt length
    (max_tokens vs max_seq_len) are checked later by SamplingParams.validate.
    """
    known = {s.name for s in INPUTS}
    for name in arrays:
        if name not in known:
            raise ValueError(f"unknown input {name!r}; allowed: {', '.join(sorted(known))}")
    params = _sampling_params(arrays, row, batch)
    _add_word_lists(params, arrays, row, batch)
    _add_stop_ids(params, arrays, row, batch, vocab_size)
    flags = {}
    _add_guide(params, arrays, row, batch)
    for tname in ("stream", "exclude_input_in_output", "return_log_probs", "return_num_input_tokens",
                  "return_num_output_tokens"):
        a = _row(arrays, tname, row, batch)
        flags[tname] = None if a is None else _scalar(tname, a, bool)
    return_log_probs = bool(flags["return_log_probs"]) or params.get("logprobs") is not None
    if return_log_probs and params.get("logprobs") is None:
        params["logprobs"] = 0
    messages = _messages(arrays, row, batch)
    tools = _tools(arrays, row, batch, messages)
    prompt, prompt_ids = (None, None) if messages is not None else _prompt(arrays, row, batch, vocab_size)
    lora_name, lora_task_id, lora_tensors = _lora(params, arrays, row, batch)
    return ParsedRequest(
        prompt=prompt, prompt_token_ids=prompt_ids, params=params, messages=messages, tools=tools,
        lora_name=lora_name, lora_task_id=lora_task_id, lora_tensors=lora_tensors,
        stream=bool(flags["stream"]),
        exclude_input_in_output=True if flags["exclude_input_in_output"] is None else flags["exclude_input_in_output"],
        return_log_probs=return_log_probs)


def _lora(params: dict, arrays: Dict[str, np.ndarray], row: int, batch: int):
    """(lora_name, lora_task_id, (lora_weights, lora_config) or None) of this row."""
    name = params.pop("lora_name", None)
    a = _row(arrays, "lora_task_id", row, batch)
    task_id = None if a is None else _scalar("lora_task_id", a, int)
    w, c = _row(arrays, "lora_weights", row, batch), _row(arrays, "lora_config", row, batch)
    if (w is None) != (c is None):
        raise ValueError("lora_weights and lora_config come together (with lora_task_id)")
    if w is not None and task_id is None:
        raise ValueError("lora_weights / lora_config need lora_task_id: the id they are cached under")
    if name is not None and task_id is not None:
        raise ValueError("give one of sampling_parameters.lora_name and lora_task_id")
    if task_id is not None and task_id < 0:
        raise ValueError(f"lora_task_id must be >= 0, got {task_id}")
    return name, task_id, None if w is None else (np.asarray(w), np.asarray(c))


def _messages(arrays: Dict[str, np.ndarray], row: int, batch: int) -> Optional[List[dict]]:
    """The chat `messages` of this row (None without them); they replace text_input / input_ids."""
    m = _row(arrays, "messages", row, batch)
    if m is None:
        return None
    if _row(arrays, "text_input", row, batch) is not None or _row(arrays, "input_ids", row, batch) is not None:
        raise ValueError("give one of text_input, input_ids and messages")
    flat = np.asarray(m).reshape(-1)
    if flat.size != 1:
        raise ValueError(f"messages must hold exactly one JSON string per batch row, got {flat.size}")
    return parse_messages(_text("messages", flat[0]))


def _tools(arrays: Dict[str, np.ndarray], row: int, batch: int, messages) -> Optional[List[dict]]:
    """The `tools` input: a JSON list of objects, only with messages (the chat template renders it)."""
    t = _row(arrays, "tools", row, batch)
    if t is None:
        return None
    if messages is None:
        raise ValueError("tools needs messages (the chat template renders them)")
    text = _text("tools", np.asarray(t).reshape(-1)[0])
    if len(text) > MAX_MESSAGES_CHARS:
        raise ValueError(f"tools has {len(text)} characters; at most {MAX_MESSAGES_CHARS} are allowed")
    try:
        v = json.loads(text)
    except (ValueError, RecursionError):
        raise ValueError("tools must be a JSON list of tool objects") from None
    if not isinstance(v, list) or not all(isinstance(x, dict) for x in v):
        raise ValueError("tools must be a JSON list of tool objects")
    return v or None


def _sampling_params(arrays: Dict[str, np.ndarray], row: int, batch: int) -> Dict[str, object]:
    """SamplingParams kwargs from `sampling_parameters` JSON, then the scalar tensors (which win)."""
    params: Dict[str, object] = {}
    sp = _row(arrays, "sampling_parameters", row, batch)
    if sp is not None:
        params.update(parse_sampling_parameters(_text("sampling_parameters", np.asarray(sp).reshape(-1)[0])))
    for tname, (fname, kind) in _TENSOR_PARAMS.items():
        a = _row(arrays, tname, row, batch)
        if a is None:
            continue
        v = _scalar(tname, a, kind)
        if kind is float:
            _check_finite(tname, v)
        params[fname] = v
    params.setdefault("max_tokens", DEFAULT_MAX_TOKENS)
    # Name the Triton input in errors that SamplingParams would report under another name.
    if isinstance(params.get("max_tokens"), int) and params["max_tokens"] < 1:
        raise ValueError(f"max_tokens must be >= 1, got {params['max_tokens']}")
    if "n" in params and not (isinstance(params["n"], int) and params["n"] >= 1):
        raise ValueError(f"num_return_sequences must be >= 1, got {params['n']}")
    for fname in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty"):
        if isinstance(params.get(fname), float):
            _check_finite(fname, params[fname])
    return params


def _add_guide(params: dict, arrays: Dict[str, np.ndarray], row: int, batch: int) -> None:
    """guided_decoding_guide_type / guided_decoding_guide (they win over sampling_parameters')."""
    texts = {}
    for tname in (guided_surfaces.TYPE_TENSOR, guided_surfaces.GUIDE_TENSOR):
        a = _row(arrays, tname, row, batch)
        if a is not None:
            flat = np.asarray(a).reshape(-1)
            if flat.size != 1:
                raise ValueError(f"{tname} must hold exactly one string per batch row, got {flat.size}")
            texts[tname] = _text(tname, flat[0])
    g = guided_surfaces.from_tensors(texts.get(guided_surfaces.TYPE_TENSOR), texts.get(guided_surfaces.GUIDE_TENSOR))
    if g is not None:
        params["guided"] = g


def _add_word_lists(params: dict, arrays: Dict[str, np.ndarray], row: int, batch: int) -> None:
    """stop_words and bad_words tensors, appended to the JSON's `stop` and `bad_words`."""
    for tname, fname in (("stop_words", "stop"), ("bad_words", "bad_words")):
        a = _row(arrays, tname, row, batch)
        if a is None:
            continue
        words = [_text(tname, w) for w in np.asarray(a).reshape(-1)]
        words = [w for w in words if w]  # empty strings are padding in tensorrtllm_backend clients
        params[fname] = list(params.get(fname, [])) + words


def _add_stop_ids(params: dict, arrays: Dict[str, np.ndarray], row: int, batch: int,
                  vocab_size: Optional[int]) -> None:
    """end_id joins stop_token_ids; end_id and pad_id must be token ids."""
    stop_ids = list(params.get("stop_token_ids", []))
    for tname in ("end_id", "pad_id"):
        a = _row(arrays, tname, row, batch)
        if a is None:
            continue
        v = _scalar(tname, a, int)
        if v < 0 or (vocab_size is not None and v >= vocab_size):
            raise ValueError(f"{tname} must be a token id in [0, {vocab_size}), got {v}")
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
            raise ValueError(f"text_input must hold exactly one string per batch row, got {flat.size}")
        prompt = _text("text_input", flat[0])
        if not prompt:
            raise ValueError("text_input must not be empty")
        return prompt, None
    ids = _row(arrays, "input_ids", row, batch)
    if ids is None:
        raise ValueError("text_input is required (or input_ids, or messages)")
    ids = np.asarray(ids).reshape(-1)
    if ids.dtype.kind not in "iu":
        raise ValueError(f"input_ids must be an integer tensor, got {ids.dtype}")
    lens = _row(arrays, "input_lengths", row, batch)
    if lens is not None:
        n = _scalar("input_lengths", lens, int)
        if not 0 <= n <= ids.size:
            raise ValueError(f"input_lengths must be in [0, {ids.size}], got {n}")
        ids = ids[:n]
    prompt_ids = [int(i) for i in ids]
    if not prompt_ids:
        raise ValueError("input_ids must not be empty")
    bad = [i for i in prompt_ids if i < 0 or (vocab_size is not None and i >= vocab_size)]
    if bad:
        raise ValueError(f"input_ids entry {bad[0]} is outside [0, {vocab_size})")
    return None, prompt_ids


def error_prefix(batch: int, row: int) -> str:
    """Prefix naming the row in an error for a batch > 1 request."""
    return f"batch row {row}: " if batch > 1 else ""
