"""The Triton tensor contract of the `tritium` backend: input and output tensors, response arrays.

Follows tensorrtllm_backend's ensemble names (text_input, max_tokens, stream, ..., text_output,
output_ids, ...) so its existing clients work unchanged, and also accepts vllm_backend's
`sampling_parameters` JSON string (parsed in request.py). Pure numpy: no
triton_python_backend_utils import, so it is unit-tested without a server.

Every input carries a batch dimension (max_batch_size > 0). A request with batch B > 1 is
served row by row: each row becomes its own engine request, and each response names its row
in `batch_index` (and its sample in `sequence_index` when num_return_sequences > 1).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np

from tritium.backend.guided.surfaces import TENSOR_INPUTS as _GUIDED_INPUTS
from tritium.backend.sampling_params import FIELDS


@dataclass(frozen=True)
class TensorSpec:
    name: str
    data_type: str        # Triton config type, e.g. "TYPE_FP32"
    dims: tuple           # without the batch dimension
    optional: bool = True
    doc: str = ""


def _field_input(f) -> TensorSpec:
    """The Triton input of a request field (backend/sampling_params.py declares it)."""
    default = "" if f.default is None or f.default == [] else f", default {f.default}"
    rng = f" in {f.range_text()}" if f.kind in ("int", "float") else ""
    return TensorSpec(f.tensor, f.wire_type, f.tensor_dims, doc=f"{f.name}{rng}{default}: {f.doc}")


# Inputs of the LLM model (NAME). Scalars are dims [1] per batch row, as in tensorrtllm_backend.
# The sampling inputs come from the request-field schema (SamplingParams); the others are the
# prompt and the response options, which are not sampling parameters.
PROMPT_INPUTS = (
    TensorSpec("text_input", "TYPE_STRING", (1,), doc="prompt text (UTF-8); or give input_ids"),
    TensorSpec("input_ids", "TYPE_INT32", (-1,), doc="prompt token ids; used when text_input is absent"),
    TensorSpec("input_lengths", "TYPE_INT32", (1,), doc="valid length of input_ids (right padding)"),
    TensorSpec("messages", "TYPE_STRING", (1,),
               doc='chat messages as JSON [{"role", "content"}], rendered with the engine\'s chat template; '
                   'replaces text_input'),
    TensorSpec("tools", "TYPE_STRING", (1,),
               doc="OpenAI tools as JSON [{\"type\": \"function\", \"function\": {...}}], passed to the chat "
                   "template as `tools` (with messages)"),
)
FIELD_INPUTS = tuple(_field_input(f) for f in FIELDS if f.tensor)
OPTION_INPUTS = (
    TensorSpec("stream", "TYPE_BOOL", (1,), doc="true: one response per new delta (default false)"),
    TensorSpec("end_id", "TYPE_INT32", (1,), doc="extra end-of-sequence token id (joins stop_token_ids)"),
    TensorSpec("pad_id", "TYPE_INT32", (1,), doc="accepted for compatibility (outputs are not padded)"),
    TensorSpec("exclude_input_in_output", "TYPE_BOOL", (1,), doc="default true: text_output has no prompt"),
    TensorSpec("return_log_probs", "TYPE_BOOL", (1,),
               doc="fill cum_log_probs / output_log_probs (logprobs 0 unless sampling_parameters sets it)"),
    TensorSpec("sampling_parameters", "TYPE_STRING", (1,),
               doc="vllm_backend JSON of request fields (their json keys); tensors override it"),
    # Structured outputs (backend/guided/surfaces.py declares them).
    *(TensorSpec(name, dtype, (1,), doc=doc) for name, dtype, doc in _GUIDED_INPUTS),
    # Sent by Triton's own OpenAI frontend; num_input_tokens / num_output_tokens always come back.
    TensorSpec("return_num_input_tokens", "TYPE_BOOL", (1,), doc="accepted; num_input_tokens is always returned"),
    TensorSpec("return_num_output_tokens", "TYPE_BOOL", (1,), doc="accepted; num_output_tokens is always returned"),
    # LoRA (docs/lora.md): the adapter tensors tensorrtllm_backend sends with lora_task_id (a request field)
    TensorSpec("lora_weights", "TYPE_FP16", (-1, -1),
               doc="per module: A.flatten() ++ (alpha/r * B).flatten() (TensorRT-LLM hf_lora_convert layout)"),
    TensorSpec("lora_config", "TYPE_INT32", (-1, 3), doc="per module: [module_id, layer_idx, adapter_size]"),
)
INPUTS = PROMPT_INPUTS + FIELD_INPUTS + OPTION_INPUTS

OUTPUTS = (
    TensorSpec("text_output", "TYPE_STRING", (-1,), doc="generated text (the delta when streaming)"),
    TensorSpec("output_ids", "TYPE_INT32", (-1,),
               doc="generated token ids (new ones when streaming); prompt ids first if exclude_input_in_output is false"),
    TensorSpec("finish_reason", "TYPE_STRING", (-1,),
               doc='"" until done, then "stop", "length", "abort" or "grammar_dead_end"'),
    TensorSpec("cum_log_probs", "TYPE_FP32", (-1,), doc="sum of output token logprobs so far"),
    TensorSpec("output_log_probs", "TYPE_FP32", (-1,), doc="logprob of each generated token in output_ids (needs return_log_probs)"),
    TensorSpec("num_input_tokens", "TYPE_INT32", (-1,), doc="prompt length in tokens"),
    TensorSpec("num_output_tokens", "TYPE_INT32", (-1,), doc="tokens generated so far"),
    TensorSpec("batch_index", "TYPE_INT32", (-1,), doc="row of the request batch this response is for"),
    TensorSpec("sequence_index", "TYPE_INT32", (-1,), doc="sample index when num_return_sequences > 1"),
    TensorSpec("context_ids", "TYPE_INT32", (-1,),
               doc="up to 8 ids sent before output_ids (lets a stateless postprocessor detokenize)"),
    TensorSpec("logprobs_detail", "TYPE_STRING", (-1,),
               doc='JSON, one entry per new token: {"id", "token", "logprob", "top": [{"id", "token", '
                   '"logprob"}]} (needs return_log_probs; top holds sampling_parameters.logprobs entries)'),
)

# How many already-sent ids ride along in context_ids: a UTF-8 character (at most 4 bytes, so
# 4 tokens) plus 3 more to find the character boundary before it (see decode_delta).
NUM_CONTEXT_IDS = 8


def token_logprobs(logprobs, token_ids: List[int]) -> List[float]:
    """Logprob of each sampled token from CompletionOutput.logprobs.

    Per-token entries may be {"token_id", "logprob", ...} dicts (the engine's form), a
    {token_id: logprob} dict, an object with .logprob, or a float.
    """
    if not logprobs:
        return []
    out = []
    for entry, tok in zip(logprobs, token_ids):
        if isinstance(entry, dict):
            entry = entry["logprob"] if "logprob" in entry else entry.get(tok, float("nan"))
        if hasattr(entry, "logprob"):
            entry = entry.logprob
        out.append(float(entry))
    return out


def _i32(value: int) -> np.ndarray:
    return np.array([[value]], dtype=np.int32)


def _row_i32(values: List[int]) -> np.ndarray:
    return np.array(values, dtype=np.int32).reshape(1, -1)


_EMPTY_I32 = np.zeros((1, 0), dtype=np.int32)
_EMPTY_F32 = np.zeros((1, 0), dtype=np.float32)
_NO_FINISH = np.array([[b""]], dtype=np.object_)  # these three are shared by every response: never written


def response_arrays(text: str, new_ids: List[int], finish_reason: Optional[str], cum_log_prob: Optional[float],
                    log_probs: List[float], num_input_tokens: int, num_output_tokens: int, batch_index: int,
                    sequence_index: int, context_ids: List[int],
                    logprobs_detail: Optional[str] = None, names=None,
                    constants: Optional[Dict[str, np.ndarray]] = None) -> Dict[str, np.ndarray]:
    """numpy arrays (batch dimension 1) for one response, keyed by output name.

    names: the outputs to build (None: all of them); the others are not computed. constants:
    arrays already built for num_input_tokens / batch_index / sequence_index (they do not change
    over a stream; RowStream keeps them). logprobs_detail (a JSON string) is sent only when given,
    so a repository written before it existed keeps working for every request that does not ask
    for logprobs. Responses are built once per token, so every output costs only what it needs.
    """
    def want(name: str) -> bool:
        return names is None or name in names

    const = constants or {}
    arrays = {}
    if want("text_output"):
        arrays["text_output"] = np.array([[text.encode("utf-8")]], dtype=np.object_)
    if want("output_ids"):
        arrays["output_ids"] = _row_i32(new_ids) if new_ids else _EMPTY_I32
    if want("finish_reason"):
        arrays["finish_reason"] = np.array([[finish_reason.encode()]], dtype=np.object_) if finish_reason \
            else _NO_FINISH
    if want("cum_log_probs"):
        arrays["cum_log_probs"] = np.array([[cum_log_prob if cum_log_prob is not None else 0.0]], dtype=np.float32)
    if want("output_log_probs"):
        arrays["output_log_probs"] = np.array(log_probs, dtype=np.float32).reshape(1, -1) if log_probs \
            else _EMPTY_F32
    for name, value in (("num_input_tokens", num_input_tokens), ("num_output_tokens", num_output_tokens),
                        ("batch_index", batch_index), ("sequence_index", sequence_index)):
        if want(name):
            arrays[name] = const[name] if name in const else _i32(value)
    if want("context_ids"):
        arrays["context_ids"] = _row_i32(context_ids) if context_ids else _EMPTY_I32
    if logprobs_detail is not None and want("logprobs_detail"):
        arrays["logprobs_detail"] = np.array([[logprobs_detail.encode("utf-8")]], dtype=np.object_)
    return arrays


def logprobs_detail(entries, decode) -> str:
    """JSON of the engine's per-token logprob entries ({"token_id", "logprob", "top_logprobs"}),
    each token id also as text (decode: id -> str)."""
    out = []
    for e in entries:
        out.append({"id": int(e["token_id"]), "token": decode(int(e["token_id"])), "logprob": float(e["logprob"]),
                    "top": [{"id": int(t["token_id"]), "token": decode(int(t["token_id"])),
                             "logprob": float(t["logprob"])} for t in e.get("top_logprobs") or []]})
    return json.dumps(out, ensure_ascii=False)


def resolve_path(value: str, model_dir: str) -> str:
    """A path parameter of config.pbtxt -> absolute path (`~` expands; relative to the model folder).

    $VARS do not expand: the server's environment (tokens, keys) must not leak into a path that
    load errors echo back to whoever asked to load the model.
    """
    path = os.path.expanduser(value.strip())
    return path if os.path.isabs(path) else os.path.normpath(os.path.join(model_dir, path))


OUTPUT_NAMES_PARAMETER = "output_names"


def output_names_parameter(parameters_json: str) -> Optional[set]:
    """The request parameter `output_names` ("text_output,output_ids,..."): the contract outputs a
    client wants in every response, for clients that cannot name outputs (Triton's HTTP generate
    and generate_stream pass any key that is not an input as a request parameter). None when the
    request does not set it. Raises ValueError naming the parameter and the allowed names."""
    if not parameters_json:
        return None
    try:
        params = json.loads(parameters_json)
    except ValueError:
        return None  # not ours to judge: tritonserver built this JSON
    if not isinstance(params, dict) or OUTPUT_NAMES_PARAMETER not in params:
        return None
    value = params[OUTPUT_NAMES_PARAMETER]
    allowed = [t.name for t in OUTPUTS]
    names = [n.strip() for n in value.split(",")] if isinstance(value, str) else None
    if not names or any(n not in allowed for n in names):
        raise ValueError(f"output_names must be a comma-separated list of outputs from "
                         f"{', '.join(allowed)}; got {value!r}")
    return set(names)
