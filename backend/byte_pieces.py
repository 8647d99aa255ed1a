"""The bytes of each token of a byte-level BPE tokenizer, for detokenizing one token at a time.

A tokenizer whose decoder is `ByteLevel` (GPT-2's scheme, used by SmolLM2, Llama 3, Qwen and
others) decodes a list of ids by mapping each token's characters back to the bytes they stand
for (GPT-2's printable alphabet of 256 characters, one per byte; a token with a character
outside it contributes its own UTF-8 bytes), joining the bytes, and reading them as UTF-8 with
every invalid or unfinished sequence replaced by U+FFFD. Special tokens are dropped when
skip_special_tokens is set; ids the vocabulary lacks contribute nothing. So the text of a
growing output can be built token by token, with an incremental UTF-8 decoder holding an
unfinished character back, and equals the whole decode at every step
(tests/test_detokenizer_incremental.py checks that against tokenizers' own decode).

Other decoders (SentencePiece's byte fallback and leading-space strip, WordPiece's `##`) look
at neighbouring tokens: for them token_pieces() returns None and the detokenizer decodes the
whole output each step.
"""
from __future__ import annotations

import json
import threading
from typing import Dict, FrozenSet, List, Optional, Tuple


def byte_alphabet() -> Dict[str, int]:
    """GPT-2's byte-to-character table, inverted: printable Latin-1 bytes stand for themselves,
    the other 68 bytes take the code points from 256 up, in byte order."""
    printable = [b for b in range(256) if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255]
    table = {chr(b): b for b in printable}
    extra = 256
    for b in range(256):
        if b not in printable:
            table[chr(extra)] = b
            extra += 1
    return table


class TokenPieces:
    """Per id: the bytes a token decodes to (None: the id is not in the vocabulary), and the
    ids of special tokens."""

    def __init__(self, pieces: List[Optional[bytes]], special: FrozenSet[int]):
        self.pieces, self.special = pieces, special

    def bytes_of(self, ids, skip_special_tokens: bool) -> bytes:
        pieces, special, n = self.pieces, self.special, len(self.pieces)
        return b"".join(pieces[i] for i in ids
                        if 0 <= i < n and pieces[i] is not None and not (skip_special_tokens and i in special))


_CACHE: Dict[int, Tuple[object, Optional[TokenPieces]]] = {}  # id(tokenizer) -> (tokenizer, pieces)
_LOCK = threading.Lock()


def _build(tokenizer) -> Optional[TokenPieces]:
    to_str = getattr(tokenizer, "to_str", None)
    vocab_of = getattr(tokenizer, "get_vocab", None)
    if to_str is None or vocab_of is None:
        return None
    spec = json.loads(to_str())
    decoder = spec.get("decoder") or {}
    if decoder.get("type") != "ByteLevel":
        return None
    alphabet = byte_alphabet()
    vocab = vocab_of(with_added_tokens=True)
    pieces: List[Optional[bytes]] = [None] * (max(vocab.values(), default=-1) + 1)
    for token, i in vocab.items():
        try:
            pieces[i] = bytes(alphabet[c] for c in token)
        except KeyError:  # a character outside the alphabet: the token's own UTF-8 bytes
            pieces[i] = token.encode("utf-8")
    special = frozenset(t["id"] for t in spec.get("added_tokens", ()) if t.get("special"))
    return TokenPieces(pieces, special)


def token_pieces(tokenizer) -> Optional[TokenPieces]:
    """The TokenPieces of a byte-level tokenizer (built once per tokenizer), else None."""
    with _LOCK:
        hit = _CACHE.get(id(tokenizer))
        if hit is not None and hit[0] is tokenizer:
            return hit[1]
        pieces = _build(tokenizer)
        _CACHE[id(tokenizer)] = (tokenizer, pieces)  # holds the tokenizer, so its id stays its own
        return pieces
