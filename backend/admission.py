"""Admission: turn an add_request() call into a Request, checking what depends on this engine.

SamplingParams checked its own fields when it was built; here come the limits of the engine it
is sent to (prompt and max_tokens within max_seq_len, token ids within the vocabulary, n within
max_num_seqs, the request within the KV pool) and the prompt itself (text is tokenized here).
Every refusal is a RequestError naming the field; nothing of the engine is touched.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional

from .block_manager import cdiv
from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer
from .errors import RequestError
from .prompt_limits import encode_prompt, max_token_chars
from .sampling_params import SamplingParams
from .sequence import Request


class Admission:
    """Builds checked Requests for one engine (its config, tokenizer and pool size)."""

    def __init__(self, config: EngineConfig, tokenizer, max_num_seqs: int, num_kv_blocks: int):
        self.config, self.tokenizer = config, tokenizer
        self.max_seq_len, self.block_size = config.limits.max_seq_len, config.limits.block_size
        self.max_num_seqs, self.num_kv_blocks = max_num_seqs, num_kv_blocks
        self._token_chars: Optional[int] = None  # prompt_limits.max_token_chars, computed on first use

    def prompt_ids(self, prompt: Optional[str], prompt_token_ids: Optional[List[int]]) -> List[int]:
        if (prompt is None) == (prompt_token_ids is None):
            raise RequestError("give exactly one of prompt and prompt_token_ids", field="prompt")
        vocab = self.config.model.vocab_size
        if prompt_token_ids is not None:
            ids = list(prompt_token_ids)
            for t in ids:
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                    raise RequestError(f"prompt_token_ids entries must be integers in [0, {vocab}), got {t!r}",
                                       field="prompt")
            return ids
        if not isinstance(prompt, str):
            raise RequestError(f"prompt must be a string, got {type(prompt).__name__}", field="prompt")
        if not prompt:
            raise RequestError("prompt must not be empty", field="prompt")
        if self.tokenizer is None:
            raise RequestError("this engine has no tokenizer; pass prompt_token_ids", field="prompt")
        if self._token_chars is None:
            self._token_chars = max_token_chars(self.tokenizer)
        return encode_prompt(self.tokenizer, prompt, self.max_seq_len, self._token_chars)

    def build(self, request_id: str, prompt: Optional[str], prompt_token_ids: Optional[List[int]],
              params: SamplingParams, priority: int) -> Request:
        """A Request with its sequences (and their detokenizers); RequestError if it cannot run here."""
        if not isinstance(request_id, str) or not request_id:
            raise RequestError(f"request_id must be a non-empty string, got {request_id!r}", field="request_id")
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params must be a SamplingParams, got {type(params).__name__}", field="params")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise RequestError(f"priority must be an integer, got {priority!r}", field="priority")
        ids = self.prompt_ids(prompt, prompt_token_ids)
        params.check_context(self.max_seq_len, self.config.model.vocab_size, len(ids))
        if params.max_tokens is None:  # null: up to the end of the context
            params = dataclasses.replace(params, max_tokens=self.max_seq_len - len(ids))
        if params.n > self.max_num_seqs:
            raise RequestError(f"n must be in [1, {self.max_num_seqs}] (max_num_seqs), got {params.n}", field="n")
        need = cdiv(len(ids) + params.max_tokens, self.block_size)
        if need > self.num_kv_blocks:
            raise RequestError(
                f"request can never fit: prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) needs "
                f"{need} KV blocks of {self.block_size} tokens, the pool has {self.num_kv_blocks} "
                f"(raise num_kv_blocks or lower max_tokens)", field="max_tokens", code="too_long")
        if (params.stop or params.bad_words) and self.tokenizer is None:
            raise RequestError("stop strings and bad_words need a tokenizer; this engine has none",
                               field="stop" if params.stop else "bad_words")
        req = Request(request_id, ids, params, priority, eos_token_ids=self.config.model.eos_token_ids,
                      stop_token_ids=params.stop_token_ids,
                      bad_words_ids=self._bad_words_ids(params.bad_words) if params.bad_words else ())
        for seq in req.seqs:
            seq.detok = IncrementalDetokenizer(self.tokenizer, params.stop) if self.tokenizer else None
        return req

    def _bad_words_ids(self, words) -> List[List[int]]:
        """Each word's token ids, alone and after a space (how it appears mid-text)."""
        out = []
        for w in words:
            for variant in {w, w if w.startswith(" ") else " " + w}:
                ids = self.tokenizer.encode(variant, add_special_tokens=False).ids
                if ids and ids not in out:
                    out.append(ids)
        return out
