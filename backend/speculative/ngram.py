"""N-gram proposer: prompt lookup decoding (Saxena, "Prompt Lookup Decoding", 2023; the same idea
as LLMA, Yang et al., "Inference with Reference", 2023).

The last n tokens of a sequence (n from ngram_max down to ngram_min) are looked up in its own
prompt and output; at the most recent earlier occurrence (that is followed by k tokens, if any), the k tokens that followed it are the
proposal. Input-grounded tasks (summarise or edit a given text, extract from a document) copy
spans of the input, so such proposals are often right. No model runs: a proposal costs a scan.
"""
from __future__ import annotations

from typing import List

import numpy as np


def ngram_propose(token_ids: List[int], k: int, n_min: int, n_max: int) -> List[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix
    n-gram (n_max >= n >= n_min); [] when none matches."""
    length = len(token_ids)
    if k <= 0 or length < n_min + 1:
        return []
    arr = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = arr[length - n:]
        # Candidate starts i < length - n (the suffix itself excluded); windows arr[i:i+n].
        windows = np.lib.stride_tricks.sliding_window_view(arr[:length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            # The most recent occurrence followed by k tokens, else the most recent one.
            full = hits[hits + n + k <= length]
            start = int(full[-1] if full.size else hits[-1]) + n
            return arr[start:start + k].tolist()
    return []
