"""pb_utils.Tensors of small response outputs whose values repeat, built once and sent again.

A streamed response carries a few tiny outputs per token (`output_ids` [[id]], `text_output`
[[b"piece"]], `num_output_tokens` [[k]], `num_input_tokens`, ...), and building a
pb_utils.Tensor costs the delivery thread 20-25 us each (docs/benchmarks.md "Server overhead per
token"). Their values repeat: across streams and tokens the same token ids, text pieces and
counts come back. The Python backend saves a Tensor into its shared memory once, on its first
send, and a later response that names the same Tensor points at that copy (the response send
waits until tritonserver has read the response's outputs), so a cached Tensor costs a dict
look-up. Only integer outputs of at most MAX_INTS values and byte strings of at most
MAX_TEXT_BYTES are cached; floats (log probs) and longer outputs are built per response.

Used only by the delivery thread (one per model instance). Bounded: when it holds `limit`
Tensors it is cleared (their shared memory goes back to the stub's pool once no response in
flight names them).
"""
from __future__ import annotations

from typing import Dict

import numpy as np

MAX_INTS = 2
MAX_TEXT_BYTES = 48
DEFAULT_LIMIT = 16384


class TensorCache:
    """Keys are (output name, value): value the bytes of a one-string output, or the tuple of an
    int32 output's values (every output of the contract has batch dimension 1, shape [1, n])."""

    def __init__(self, tensor_type, limit: int = DEFAULT_LIMIT):
        self._tensor = tensor_type   # pb_utils.Tensor (any callable (name, ndarray) -> tensor in tests)
        self._limit = int(limit)
        self._cache: Dict[tuple, object] = {}
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._cache)

    @staticmethod
    def key(name: str, a: np.ndarray):
        """The cache key of output `name` holding `a`, or None when `a` is not cached."""
        if a.ndim != 2 or a.shape[0] != 1:
            return None
        if a.dtype == np.int32:
            return (name, tuple(a[0].tolist())) if a.size <= MAX_INTS else None
        if a.dtype == np.object_ and a.shape == (1, 1):
            v = a[0, 0]
            return (name, v) if isinstance(v, bytes) and len(v) <= MAX_TEXT_BYTES else None
        return None

    def cached(self, key):
        """The Tensor cached under `key` (see key()), or None."""
        t = self._cache.get(key)
        if t is not None:
            self.hits += 1
        return t

    def add(self, key, name: str, a: np.ndarray):
        """Build pb_utils.Tensor(name, a), cache it under `key` (None: not cached), return it."""
        t = self._tensor(name, a)
        if key is not None:
            self.misses += 1
            if len(self._cache) >= self._limit:
                self._cache.clear()
            self._cache[key] = t
        return t

    def tensor(self, name: str, a: np.ndarray):
        """pb_utils.Tensor(name, a), from the cache when an equal one was built before."""
        key = self.key(name, a)
        t = self.cached(key) if key is not None else None
        return t if t is not None else self.add(key, name, a)
