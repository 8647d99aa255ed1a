"""Bad-word token sequences indexed once per request, so a step's cost does not grow with their number.

A bad word w = (t_1, ..., t_k) bans its last token t_k at a step whose last k - 1 generated
tokens are (t_1, ..., t_{k-1}). The index groups the words by prefix length and prefix: a step
looks up one tuple per distinct prefix length (at most the longest word's token count, which
SamplingParams caps through the word's character length), whatever the number of words.
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch


class BadWordsIndex:
    """Lookup of the tokens to ban given a sequence's token ids."""

    def __init__(self, words: Sequence[Sequence[int]]):
        always = sorted({w[0] for w in words if len(w) == 1})
        # Single-token words are banned at every step: one precomputed index tensor.
        self.always = torch.tensor(always, dtype=torch.long) if always else None
        # prefix length -> prefix -> last tokens that the prefix bans
        self.by_prefix: Dict[int, Dict[Tuple[int, ...], List[int]]] = {}
        for w in words:
            if len(w) > 1:
                self.by_prefix.setdefault(len(w) - 1, {}).setdefault(tuple(w[:-1]), []).append(w[-1])

    def __bool__(self) -> bool:
        return self.always is not None or bool(self.by_prefix)

    def context_bans(self, token_ids: Sequence[int]) -> List[int]:
        """Last tokens of the multi-token words whose prefix ends `token_ids`."""
        out: List[int] = []
        n = len(token_ids)
        for k, table in self.by_prefix.items():
            if n >= k:
                hit = table.get(tuple(token_ids[n - k:]))
                if hit:
                    out.extend(hit)
        return out
