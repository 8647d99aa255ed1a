"""Reject an over-long text prompt after tokenizing only a bounded head of it.

No token decodes to more than `max_token_chars` characters (bounded above by the longest
vocabulary entry), so a head of (max_seq_len + 2) * max_token_chars characters that already makes
max_seq_len + 1 tokens proves the whole prompt is too long: a megabyte prompt costs the
tokenization of a few thousand tokens, not of the megabyte. (A head ends mid-word at worst, which
can merge or split one token: hence the + 1 and + 2 margins.)
"""
from __future__ import annotations

from typing import List

from .errors import RequestError


def max_token_chars(tokenizer) -> int:
    """An upper bound on the characters one token decodes to (the longest vocabulary entry;
    byte-fallback entries such as "<0x41>" only make it larger, which keeps it a bound)."""
    return max((len(t) for t in tokenizer.get_vocab(with_added_tokens=True)), default=1) or 1


def encode_prompt(tokenizer, text: str, max_seq_len: int, token_chars: int) -> List[int]:
    """tokenizer.encode(text).ids, or RequestError (too_long) (naming the limit) for a prompt that cannot fit."""
    head_chars = (max_seq_len + 2) * token_chars
    if len(text) > head_chars:
        num_head = len(tokenizer.encode(text[:head_chars]).ids)
        if num_head > max_seq_len:
            raise RequestError(f"prompt has at least {num_head - 1} tokens (its first {head_chars} characters "
                             f"alone make {num_head}); the engine's max_seq_len is {max_seq_len}, so prompts "
                               f"must have at most {max_seq_len - 1} tokens", field="prompt", code="too_long")
    return tokenizer.encode(text).ids
