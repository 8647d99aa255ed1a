"""Tokenizer models of the ensemble: NAME_preprocessing (text -> ids) and NAME_postprocessing
(ids -> text, stateless and streaming-safe).

The repository writer puts a two-line model.py in each model folder that imports the classes
below, so the code lives in the installed package. Both read `tokenizer.json` from the
`tokenizer_dir` parameter (the engine folder; `~` and paths relative to the model folder
expand, $VARS do not). Encoding and decoding match the engine (special tokens added on encode,
skipped on decode).
"""
from __future__ import annotations

import json
import os
from typing import List, Optional

import numpy as np

from tritium.backend.errors import RequestError, to_wire
from tritium.backend.prompt_limits import encode_prompt, max_token_chars
from tritium.backend.triton_backend.contract import resolve_path

REPLACEMENT_CHAR = "\ufffd"


def load_tokenizer_from_params(args: dict, with_max_seq_len: bool = False):
    """tokenizers.Tokenizer from the model config's `tokenizer_dir` parameter; with
    with_max_seq_len, (tokenizer, the engine's max_seq_len or None when there is no engine.json)."""
    from tokenizers import Tokenizer
    cfg = json.loads(args["model_config"])
    value = cfg.get("parameters", {}).get("tokenizer_dir", {}).get("string_value", "")
    if not value.strip():
        raise ValueError(f"model '{args['model_name']}' needs parameter tokenizer_dir")
    path = os.path.join(resolve_path(value, args["model_repository"]), "tokenizer.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"tokenizer_dir: {path} not found")
    tok = Tokenizer.from_file(path)
    if not with_max_seq_len:
        return tok
    try:
        with open(os.path.join(os.path.dirname(path), "engine.json"), encoding="utf-8") as f:
            max_seq_len = int(json.load(f)["limits"]["max_seq_len"])
    except (OSError, ValueError, KeyError, TypeError):
        max_seq_len = None
    return tok, max_seq_len


def _splits_cleanly(dec, ids: List[int], s: int) -> bool:
    """True when position s of ids is a character boundary: decoding the (up to) 3 ids before it
    and the id at it separately gives the same characters as decoding them together (a UTF-8
    character has at most 4 bytes). Spaces are ignored, because SentencePiece drops the leading
    space of a decode's first token."""
    left, right = ids[max(0, s - 3):s], ids[s:s + 1]
    return dec(left + right).replace(" ", "") == (dec(left) + dec(right)).replace(" ", "")


def decode_delta(tokenizer, context_ids: List[int], new_ids: List[int], final: bool) -> str:
    """Text that `new_ids` add after `context_ids` (the last ids already sent, NUM_CONTEXT_IDS).

    Windowed like vLLM's incremental detokenizer: decode(window + new) minus decode(window),
    where the window is the shortest tail of the context that starts on a character boundary
    (never inside a multi-byte character cut by the context's start) and holds a real
    character before any held-back U+FFFD run. A trailing U+FFFD means
    the last character is incomplete: it is held back (its ids come back as context next
    time) unless this is the final response, so the deltas join to exactly the full decode.
    Leading-space rules (SentencePiece, byte-level BPE) cancel out because both decodes start
    at the same token.
    """
    ctx, new = list(context_ids), list(new_ids)

    def dec(ids):
        return tokenizer.decode(ids, skip_special_tokens=True) if ids else ""
    # The window must start on a character boundary and hold the whole held-back U+FFFD run
    # (it ends at the last real character inside the window).
    start = len(ctx) - 1
    while start > 0 and not (_splits_cleanly(dec, ctx, start) and dec(ctx[start:]).rstrip(REPLACEMENT_CHAR)):
        start -= 1
    ctx = ctx[max(start, 0):]
    prefix = dec(ctx).rstrip(REPLACEMENT_CHAR)
    full = dec(ctx + new)
    if not final:
        full = full.rstrip(REPLACEMENT_CHAR)
    return full[len(prefix):] if full.startswith(prefix) else ""


def _opt(request, name) -> Optional[np.ndarray]:
    import triton_python_backend_utils as pb_utils
    t = pb_utils.get_input_tensor_by_name(request, name)
    return None if t is None else t.as_numpy()


class PreprocessingModel:
    """text_input [B, 1] bytes -> input_ids [B, L] int32 (right padded with 0), input_lengths [B, 1]."""

    def initialize(self, args):
        self.tokenizer, self.max_seq_len = load_tokenizer_from_params(args, with_max_seq_len=True)
        self.token_chars = max_token_chars(self.tokenizer)

    def _encode(self, text: str) -> List[int]:
        if self.max_seq_len is None:
            return self.tokenizer.encode(text).ids
        return encode_prompt(self.tokenizer, text, self.max_seq_len, self.token_chars)

    def execute(self, requests):
        import triton_python_backend_utils as pb_utils
        responses = []
        for request in requests:
            try:
                texts = _opt(request, "text_input")
                if texts is None:
                    raise RequestError("text_input is required", field="prompt")
                rows = []
                for v in texts.reshape(texts.shape[0], -1)[:, 0]:
                    try:
                        s = bytes(v).decode("utf-8")
                    except UnicodeDecodeError:
                        raise RequestError("text_input must be UTF-8 text", field="prompt") from None
                    if not s:
                        raise RequestError("text_input must not be empty", field="prompt")
                    rows.append(self._encode(s))
                width = max(len(r) for r in rows)
                ids = np.zeros((len(rows), width), dtype=np.int32)
                for i, r in enumerate(rows):
                    ids[i, :len(r)] = r
                lens = np.array([[len(r)] for r in rows], dtype=np.int32)
                responses.append(pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor("input_ids", ids), pb_utils.Tensor("input_lengths", lens)]))
            except ValueError as e:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(to_wire(e))))
        return responses


class PostprocessingModel:
    """output_ids [B, L] (+ context_ids, finish_reason) -> text_output [B, 1].

    One call per streamed LLM response; no state between calls. The prompt echo needs nothing
    here: with exclude_input_in_output false the LLM puts the prompt ids in front of output_ids
    (tensorrtllm_backend's convention), so they decode with the rest.
    """

    def initialize(self, args):
        self.tokenizer = load_tokenizer_from_params(args)

    def execute(self, requests):
        import triton_python_backend_utils as pb_utils
        responses = []
        for request in requests:
            ids = _opt(request, "output_ids")
            if ids is None:
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError("output_ids is required")))
                continue
            ids = ids.reshape(ids.shape[0], -1)
            ctx = _opt(request, "context_ids")
            fin = _opt(request, "finish_reason")
            out = []
            for b in range(ids.shape[0]):
                context = [] if ctx is None else [int(x) for x in ctx.reshape(ctx.shape[0], -1)[min(b, ctx.shape[0] - 1)]]
                final = fin is None or bool(bytes(fin.reshape(fin.shape[0], -1)[min(b, fin.shape[0] - 1)][0]))
                text = decode_delta(self.tokenizer, context, [int(x) for x in ids[b]], final)
                out.append([text.encode("utf-8")])
            responses.append(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor("text_output", np.array(out, dtype=np.object_))]))
        return responses
