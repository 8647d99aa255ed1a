"""Incremental detokenization with stop strings, for streamed text that equals the whole text.

The invariant: the deltas a sequence emits, joined, are byte for byte `tokenizer.decode(ids)` of
its final output ids (stop string and everything after it cut off). Windowed tricks (decode the
last few tokens, diff against a shorter window) break it for decoders that look at context:
SentencePiece's leading-space strip, byte-fallback runs, byte-level BPE's multi-byte characters.
So decoders that look at neighbouring tokens decode the whole output each step, while for
byte-level BPE tokenizers (backend/byte_pieces.py: each token stands for fixed bytes) it appends the new tokens' bytes to an incremental UTF-8 decoder, which
gives the same text at every step for a cost that does not grow with the output
(docs/benchmarks.md, "Server overhead per token"). Either way it emits only the part that can no
longer change:
  - a trailing run of U+FFFD is held back: it is usually an incomplete UTF-8 character whose
    remaining bytes are in the next token (it is released if later text follows it, or at the end);
  - a suffix that is a prefix of a stop string is held back until it either completes the stop
    string (then it is dropped) or stops matching.
Stop strings are searched with one compiled pattern and held-back prefixes found in a set of
all their proper prefixes, so a step costs the same for 1 or 32 stop strings (their number and
length are capped by SamplingParams).
"""
from __future__ import annotations

import codecs
import re
from typing import FrozenSet, List, Optional, Sequence as Seq

from .byte_pieces import token_pieces

REPLACEMENT_CHAR = "\ufffd"


def stop_prefixes(stops: Seq[str]) -> FrozenSet[str]:
    """Every proper, non-empty prefix of the stop strings."""
    return frozenset(s[:k] for s in stops for k in range(1, len(s)))


def stop_prefix_overlap(text: str, stops: Seq[str], prefixes: Optional[FrozenSet[str]] = None) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    prefixes = stop_prefixes(stops) if prefixes is None else prefixes
    longest = max((len(s) for s in stops), default=1) - 1
    for k in range(min(longest, len(text)), 0, -1):
        if text[len(text) - k:] in prefixes:
            return k
    return 0


class IncrementalDetokenizer:
    """Turns a growing list of generated token ids into text deltas for one sequence."""

    def __init__(self, tokenizer, stop: Seq[str] = (), skip_special_tokens: bool = True,
                 whole_decode: bool = False):
        """stop: non-empty stop strings (SamplingParams normalizes them: the one place).
        whole_decode: decode the whole output every step even for a byte-level tokenizer (what
        client/bench/detok_bench.py compares against)."""
        assert all(stop), "empty stop strings are dropped by SamplingParams"
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        # Leftmost match; at one position the earlier stop string in the list wins.
        self._stop_re = re.compile("|".join(re.escape(s) for s in self.stop)) if self.stop else None
        self._prefixes = stop_prefixes(self.stop)
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: List[int] = []
        self.text = ""          # current full decode (after a stop match: cut before it)
        self.emitted_len = 0    # characters of self.text already handed out
        self.stop_matched: Optional[str] = None
        self._pieces = None if whole_decode else token_pieces(tokenizer)  # None: the whole decode each step
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace") if self._pieces is not None else None
        self._decoded = ""      # text of the complete characters so far (byte-level tokenizers)

    def add_tokens(self, new_ids: Seq[int], check_stop: bool = True) -> Optional[str]:
        """Append tokens; returns the stop string if one now appears in the text, else None.

        check_stop False (e.g. before min_tokens) still decodes but does not look for stops.
        """
        assert self.stop_matched is None, "sequence already stopped"
        self.token_ids.extend(new_ids)
        if self._pieces is None:
            self.text = self.tokenizer.decode(self.token_ids, skip_special_tokens=self.skip_special_tokens)
        else:
            self._decoded += self._utf8.decode(self._pieces.bytes_of(new_ids, self.skip_special_tokens))
            # Bytes held back at the end (an unfinished character; CPython also holds some
            # invalid pairs, e.g. ED B9) read as the whole decode reads them: U+FFFD each part.
            pending = self._utf8.getstate()[0]
            self.text = self._decoded + pending.decode("utf-8", "replace") if pending else self._decoded
        if check_stop and self.stop:
            # Emitted text is final, so only the held-back tail can start a match; the tail
            # is short (a partial stop string or an unfinished character).
            m = self._stop_re.search(self.text, self.emitted_len)
            if m is not None:
                self.text = self.text[:m.start()]
                self.stop_matched = m.group(0)
                return self.stop_matched
        return None

    def delta(self, finished: bool) -> str:
        """The text that is now final and not yet emitted; everything left when finished."""
        end = len(self.text)
        if not finished:
            stripped = self.text.rstrip(REPLACEMENT_CHAR)
            end = len(stripped)
            if self.stop:
                end -= stop_prefix_overlap(stripped, self.stop, self._prefixes)
        if end <= self.emitted_len:
            return ""
        out = self.text[self.emitted_len:end]
        self.emitted_len = end
        return out

    @property
    def emitted_text(self) -> str:
        return self.text[:self.emitted_len]
