"""Decode bursts: several greedy decode steps in one native call, then appended one by one.

A single stream on CPU spends a fixed slice of every token in Python (the engine's schedule and
postprocess, and a served stream's response through the backend stub and tritonserver) while the
memory bus idles. For a decode-only step whose every row takes the plain argmax of its logits,
the native call (kernels/cpu_decode_burst.c) runs up to K steps itself, feeding each row's argmax
back as its next input; the engine then appends the K tokens of every row in order, exactly as K
steps would (stop ids, stop strings, max_tokens, detokenization, prefix hashes over the tokens
appended, counters), and the request gets one output carrying all its new tokens.

Who bursts (plan): at most MAX_BURST_ROWS rows, every one a decode of one token on the native
fast path whose call runs the model's lookup and head itself (no block copies, no
preemption, every running sequence scheduled), greedy with nothing asked of its logits
(as sampler._plain_greedy: no logprobs, penalties, logit_bias, bad words, guide; a min_tokens
ban no longer pending), no LoRA, no speculative decoding, no pending fork; and nobody waiting, so a new
request never waits behind a burst. K = min(the maximum burst, every row's remaining max_tokens and
room to max_seq_len); the K - 1 extra tokens' KV slots are taken first through the block manager's
check / act pair, else no burst. The call stops after a step where a row produced one of its stop
ids; a row that finished earlier (a stop string, another row's stop id ends the burst) drops its
later tokens. The same bits as K steps: tests/test_decode_burst.py.

The maximum burst: the engine option max_decode_burst (LLMEngine(max_decode_burst=...), the
model's config.pbtxt parameter, `tritium generate --max-decode-burst`), overridden by
TRITIUM_DECODE_BURST (read every step, for A/B runs); 1 turns bursts off.
"""
from __future__ import annotations

import os
import time
from typing import Dict, List, Optional

from .block_manager import cdiv
from .sequence import SequenceStatus

ENV = "TRITIUM_DECODE_BURST"
DEFAULT_MAX_DECODE_BURST = 8
MAX_DECODE_BURST = 256
# Steps of more rows do not burst: a request that arrives during a burst waits for its end, and a
# burst of a 16-row batch lasts K of its long steps (measured at concurrency 16, int8 SmolLM2,
# max burst 8: time to first token p50 428 vs 173 ms, p90 1797 vs 331, for no clear gain in
# throughput; docs/benchmarks.md#decode-bursts), while a few rows' steps are short.
MAX_BURST_ROWS = 4

_parsed = (None, None)  # (the raw TRITIUM_DECODE_BURST value last parsed, its value or None when unset)


def check_max_burst(value, where: str = "max_decode_burst") -> int:
    """value as a maximum burst: an integer in [1, MAX_DECODE_BURST]; ValueError naming `where`."""
    try:
        v = int(str(value).strip())
    except ValueError:
        raise ValueError(f"{where} must be an integer in [1, {MAX_DECODE_BURST}] (1: off), got {value!r}") from None
    if not 1 <= v <= MAX_DECODE_BURST:
        raise ValueError(f"{where} must be an integer in [1, {MAX_DECODE_BURST}] (1: off), got {v}")
    return v


def env_max_burst() -> Optional[int]:
    """TRITIUM_DECODE_BURST as an integer (None: unset), parsed only when it changed."""
    global _parsed
    raw = os.environ.get(ENV)
    if raw != _parsed[0]:
        _parsed = (raw, None if raw is None or not raw.strip() else check_max_burst(raw, ENV))
    return _parsed[1]


def _row_ok(seq) -> bool:
    """Whether a row's next tokens are the plain argmax of its raw logits (sampler._plain_greedy,
    with a min_tokens already reached: its ban is over) and nothing else waits on its steps."""
    req, p = seq.request, seq.request.params
    return (p.is_greedy and p.logprobs is None and seq.guide is None and not p.logit_bias and not req.bad_words
            and p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
            and seq.num_output_tokens >= p.min_tokens and req.lora is None and not seq.spec_token_ids
            and seq.num_computed_tokens + 1 == seq.num_tokens
            and all(s.status != SequenceStatus.PENDING_FORK for s in req.seqs))


def plan(engine, sched) -> int:
    """The burst length K this step runs (1: none), after taking the KV slots of the K - 1 extra
    tokens of every row (BlockManager.can_append / append_slots)."""
    env = env_max_burst()
    k = env if env is not None else engine.max_decode_burst
    sc, bm = engine.scheduler, engine.block_manager
    if (k <= 1 or engine.speculator is not None or engine.lora is not None or sc.waiting or sched.block_copies
            or sched.preempted or len(sched.seqs) != len(sc.running)
            or len(sched.seqs) > MAX_BURST_ROWS):
        return 1
    for seq, n in zip(sched.seqs, sched.num_new_tokens):
        if n != 1 or not _row_ok(seq):
            return 1
        k = min(k, seq.request.params.max_tokens - seq.num_output_tokens, engine.max_seq_len - seq.num_tokens)
        if k <= 1:
            return 1
    ready = getattr(engine.runner, "burst_ready", None)  # a tensor-parallel runner has none
    if ready is None or not ready():
        return 1
    bs = bm.block_size
    need = sum(max(cdiv(s.num_computed_tokens + k, bs) - len(s.block_table), 0) for s in sched.seqs)
    if need > bm.num_free_blocks or not all(bm.can_append(s, k) for s in sched.seqs):
        return 1
    for seq in sched.seqs:
        copies = bm.append_slots(seq, k)
        assert not copies  # no copy-on-write: the step's own block is already the row's
    return k


def stop_ids(sched) -> List[List[int]]:
    """Each row's token ids that end it (EOS unless ignore_eos, stop_token_ids)."""
    return [sorted(s.request.eos_token_ids | s.request.stop_token_ids) for s in sched.seqs]


def postprocess(engine, sched, tokens: List[List[int]]):
    """Append a burst's tokens (one list of every row's token per step) as that many steps would;
    returns the outputs of the requests that changed (one each)."""
    now = time.monotonic()
    bm = engine.block_manager
    touched: Dict[str, object] = {}
    for step_tokens in tokens:
        engine.num_steps += 1
        for seq, tok in zip(sched.seqs, step_tokens):
            if seq.is_finished:
                continue  # finished earlier in the burst (or aborted): its later tokens are dropped
            seq.request.metrics.num_scheduled_tokens += 1
            engine.num_computed_tokens += 1
            seq.num_computed_tokens += 1
            bm.cache_full_blocks(seq)
            engine._append(seq, tok, None, now)
            touched[seq.request.request_id] = seq.request
    return engine._outputs(touched, now)
