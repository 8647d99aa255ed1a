"""Incremental detokenization with stop strings, for streamed text that equals the whole text.

The invariant: the deltas a sequence emits, joined, are byte for byte `tokenizer.decode(ids)` of
its final output ids (stop string and everything after it cut off). Windowed tricks (decode the
last few tokens, diff against a shorter window) break it for decoders that look at context:
SentencePiece's leading-space strip, byte-fallback runs, byte-level BPE's multi-byte characters.
So each step decodes the whole output (the Rust decoder makes that microseconds for thousands of
tokens) and emits only the part that can no longer change:
  - a trailing run of U+FFFD is held back: it is usually an incomplete UTF-8 character whose
    remaining bytes are in the next token (it is released if later text follows it, or at the end);
  - a suffix that is a prefix of a stop string is held back until it either completes the stop
    string (then it is dropped) or stops matching.
"""
from __future__ import annotations

from typing import List, Optional, Sequence as Seq, Tuple

REPLACEMENT_CHAR = "\ufffd"


def stop_prefix_overlap(text: str, stops: Seq[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class IncrementalDetokenizer:
    """Turns a growing list of generated token ids into text deltas for one sequence."""

    def __init__(self, tokenizer, stop: Seq[str] = (), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: List[int] = []
        self.text = ""          # current full decode (after a stop match: cut before it)
        self.emitted_len = 0    # characters of self.text already handed out
        self.stop_matched: Optional[str] = None

    def add_tokens(self, new_ids: Seq[int], check_stop: bool = True) -> Optional[str]:
        """Append tokens; returns the stop string if one now appears in the text, else None.

        check_stop False (e.g. before min_tokens) still decodes but does not look for stops.
        """
        assert self.stop_matched is None, "sequence already stopped"
        self.token_ids.extend(new_ids)
        self.text = self.tokenizer.decode(self.token_ids, skip_special_tokens=self.skip_special_tokens)
        if check_stop and self.stop:
            # Emitted text is final, so only the held-back tail can start a match; the tail
            # is short (a partial stop string or an unfinished character).
            start = self.emitted_len
            first: Optional[Tuple[int, str]] = None
            for s in self.stop:
                pos = self.text.find(s, start)
                if pos >= 0 and (first is None or pos < first[0]):
                    first = (pos, s)
            if first is not None:
                self.text = self.text[:first[0]]
                self.stop_matched = first[1]
                return first[1]
        return None

    def delta(self, finished: bool) -> str:
        """The text that is now final and not yet emitted; everything left when finished."""
        end = len(self.text)
        if not finished:
            stripped = self.text.rstrip(REPLACEMENT_CHAR)
            end = len(stripped)
            if self.stop:
                end -= stop_prefix_overlap(stripped, self.stop)
        if end <= self.emitted_len:
            return ""
        out = self.text[self.emitted_len:end]
        self.emitted_len = end
        return out

    @property
    def emitted_text(self) -> str:
        return self.text[:self.emitted_len]
