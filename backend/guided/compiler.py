"""Compile guides once per (guide, tokenizer), off the engine's critical path.

GuideCompiler belongs to one engine (so one tokenizer). submit() turns the guide into an
xgrammar Grammar at once (fast; a guide that does not convert raises ValueError here, so the
request fails before it is queued) and compiles it against the vocabulary in a worker thread
while the prompt prefills; the row waits at its first sample only if compilation is not done.
Compiled grammars are kept in an LRU of MAX_CACHED_GUIDES entries keyed by (kind, guide).
"""
from __future__ import annotations

from .xgr import xgrammar

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import List, Sequence

from .params import GuidedDecodingParams

MAX_CACHED_GUIDES = 256
COMPILE_THREADS = 1  # the engine loop keeps the other cores; compiles are tens of ms


def tokenizer_info(tokenizer, vocab_size: int, eos_token_ids: Sequence[int]):
    """xgrammar TokenizerInfo from a `tokenizers.Tokenizer` (its tokenizer.json decides the
    vocabulary encoding: byte-level BPE, byte fallback or raw). vocab_size is the model's (the
    LM head may be padded past the tokenizer); ids without a token are never allowed."""
    xgr = xgrammar()
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer.to_str())
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    encoded: List[str] = [""] * max(vocab_size, max(vocab.values()) + 1)
    for tok, i in vocab.items():
        encoded[i] = tok
    return xgr.TokenizerInfo(encoded[:vocab_size], vocab_type=meta["vocab_type"], vocab_size=vocab_size,
                             stop_token_ids=sorted(eos_token_ids), add_prefix_space=meta["add_prefix_space"])


class GuideCompiler:
    """Per-engine compile cache and worker pool (thread-safe: surfaces may submit from their own
    threads to warm the cache)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int],
                 max_cached: int = MAX_CACHED_GUIDES, threads: int = COMPILE_THREADS):
        self._tokenizer, self.vocab_size, self._eos = tokenizer, vocab_size, tuple(eos_token_ids)
        self.max_cached = max_cached
        self._lock = threading.Lock()
        self._cache: "OrderedDict[tuple, Future]" = OrderedDict()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tritium-guide")
        self._compiler = None
        self.num_compiles = 0
        self.num_hits = 0

    def _xgr_compiler(self):
        if self._compiler is None:  # under self._lock
            xgr = xgrammar()
            info = tokenizer_info(self._tokenizer, self.vocab_size, self._eos)
            # xgrammar's own cache off: ours bounds the count and holds the futures.
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def warm_up(self) -> None:
        """Build the vocabulary tables now (else at the first submit)."""
        with self._lock:
            self._xgr_compiler()

    def submit(self, guided: GuidedDecodingParams) -> Future:
        """Future of the CompiledGrammar; ValueError now if the guide does not convert."""
        key = (guided.kind, guided.guide)
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                self.num_hits += 1
                return fut
        grammar = guided.validate().grammar()  # outside the lock: may take a few ms
        with self._lock:
            fut = self._cache.get(key)
            if fut is None:
                compiler = self._xgr_compiler()
                fut = self._pool.submit(compiler.compile_grammar, grammar)
                self._cache[key] = fut
                self.num_compiles += 1
                while len(self._cache) > self.max_cached:
                    self._cache.popitem(last=False)  # running matchers keep their grammar alive
        return fut

    def compile(self, guided: GuidedDecodingParams):
        """Blocking compile (benchmarks, warm-up)."""
        return self.submit(guided).result()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
