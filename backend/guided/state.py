"""Per-sequence grammar state and the engine's hooks (docs/structured-outputs.md).

Each constrained Sequence owns a GuideState: an xgrammar GrammarMatcher over the tokens it has
generated (n > 1 samples each have their own). The engine calls:
  attach(engine, req)              add_request: compile starts, one GuideState per sample;
  mask_logits(logits, seqs)        first step of the sampler: disallowed tokens -> -inf, so bans,
                                   penalties, temperature, top-k/p and logprobs all see the
                                   constrained distribution;
  dead_end(seq, tok, ...)          before a token is appended: advances the matcher; a token
                                   the grammar does not allow (none was left) finishes the
                                   sequence with "grammar_dead_end" instead;
  trim_proposals(seqs)             speculative decoding, before the forward: a proposal is cut at
                                   its first token the grammar rejects (the matcher is rolled back);
  mask_proposal_rows(rows, seq)    verification: row j masked for the state after s_1..s_j.
Preemption and recompute keep a sequence's token ids, so its matcher stays valid; prefix caching
only concerns the prompt. EOS is allowed only where the grammar may terminate.
"""
from __future__ import annotations

from .xgr import xgrammar

import threading
from concurrent.futures import Future
from typing import List, Optional, Sequence as Seq

import torch

DEAD_END = "grammar_dead_end"
NEG_INF = float("-inf")


_compiler_lock = threading.Lock()


def compiler_of(engine):
    """The engine's GuideCompiler (engine.guide_compiler), made on first use. Building its
    vocabulary tables takes seconds on a 49k-token vocabulary (mostly importing xgrammar), so a
    server calls this once in a background thread at load (warm_up)."""
    from .compiler import GuideCompiler
    with _compiler_lock:
        if getattr(engine, "guide_compiler", None) is None:
            c = GuideCompiler(engine.tokenizer, engine.config.model.vocab_size, engine.config.model.eos_token_ids)
            c.warm_up()
            engine.guide_compiler = c
    return engine.guide_compiler


def warm_up(engine) -> None:
    """Build the engine's GuideCompiler in a daemon thread (no-op without a tokenizer)."""
    if engine.tokenizer is not None:
        threading.Thread(target=compiler_of, args=(engine,), name="tritium-guide-warmup", daemon=True).start()


def attach(engine, req):
    """A constrained request: start compiling its guide with the engine's GuideCompiler (made on
    first use, as engine.guide_compiler) and give each sample its GuideState. Returns req.
    ValueError naming the field if the guide cannot be honoured (nothing is queued then)."""
    g = req.params.guided
    if g is None:
        return req
    if engine.tokenizer is None:
        raise ValueError(f"{g.source}: guided decoding needs a tokenizer; this engine has none")
    future = compiler_of(engine).submit(g)
    for seq in req.seqs:
        seq.guide = GuideState(future)
    return req


class GuideState:
    """The matcher of one sequence, created at its first sample (waiting for the compile then)."""
    __slots__ = ("future", "_matcher", "error")

    def __init__(self, future: Future):
        self.future = future
        self._matcher = None
        self.error: Optional[str] = None  # set when the grammar failed to compile in the worker

    @property
    def matcher(self):
        if self._matcher is None and self.error is None:
            xgr = xgrammar()
            try:
                compiled = self.future.result()
            except Exception as e:  # noqa: BLE001 -- reported as the finish reason, never raised in the step
                self.error = f"{type(e).__name__}: {e}"
                return None
            self._matcher = xgr.GrammarMatcher(compiled, max_rollback_tokens=-1)
        return self._matcher


def _bitmask(n: int, vocab: int):
    xgr = xgrammar()
    return xgr.allocate_token_bitmask(n, vocab)


def mask_logits(logits: torch.Tensor, seqs: Seq) -> None:
    """In place: for each row whose sequence is constrained, -inf on tokens its grammar forbids
    now. A row with nothing allowed is left all -inf (accept() then ends it as a dead end)."""
    rows = [i for i, s in enumerate(seqs) if getattr(s, "guide", None) is not None]
    if not rows:
        return
    xgr = xgrammar()
    bm = _bitmask(len(logits), logits.shape[1])
    for i in rows:
        m = seqs[i].guide.matcher
        if m is None:
            bm[i].zero_()
        else:
            m.fill_next_token_bitmask(bm, i)
    if logits.device.type != "cpu":  # the device sampler: the mask goes to the logits' device
        bm = bm.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bm, indices=rows)


def dead_end(seq, tok: int, entry: Optional[dict], scheduler) -> bool:
    """Advance seq's matcher by tok. If tok is not allowed (no allowed token was left, or the
    grammar failed to compile), finish seq with DEAD_END and return True. The grammar
    terminates only on an end token (EOS), which ends the sequence anyway (ignore_eos is refused
    with a guide). Cleans the token's logprob entry."""
    clean_logprob_entry(entry)
    m = seq.guide.matcher
    if m is not None and m.accept_token(tok):
        return False
    scheduler.finish(seq, DEAD_END)
    return True


def clean_logprob_entry(entry: Optional[dict]) -> None:
    """Top logprobs of a constrained row: drop forbidden tokens (-inf), which can fill the top N
    when fewer than N tokens are allowed."""
    if entry is not None and entry.get("top_logprobs"):
        entry["top_logprobs"] = [t for t in entry["top_logprobs"] if t["logprob"] != NEG_INF]


def valid_prefix(seq, tokens: List[int]) -> int:
    """How many leading tokens the grammar accepts after seq's tokens (matcher left unchanged)."""
    m = seq.guide.matcher
    if m is None:
        return 0
    n = 0
    for t in tokens:
        if m.is_terminated() or not m.accept_token(t):
            break
        n += 1
    if n:
        m.rollback(n)
    return n


def trim_proposals(seqs: Seq) -> None:
    """Cut each constrained sequence's speculative proposal (and draft probabilities) at its first
    token the grammar rejects, before the forward pass spends compute on it."""
    for s in seqs:
        if s.guide is not None and s.spec_token_ids:
            n = valid_prefix(s, s.spec_token_ids)
            if n < len(s.spec_token_ids):
                s.spec_token_ids = s.spec_token_ids[:n]
                if s.spec_draft_probs is not None:
                    s.spec_draft_probs = s.spec_draft_probs[:n] if n else None


def mask_proposal_rows(rows: torch.Tensor, seq, proposal: List[int]) -> None:
    """In place on the k + 1 verification rows: row j masked for the grammar state after
    proposal[:j] (the proposal was trimmed to what the grammar accepts). No-op if unconstrained."""
    if seq.guide is None:
        return
    xgr = xgrammar()
    m = seq.guide.matcher
    bm = _bitmask(rows.shape[0], rows.shape[1])
    if m is None:
        bm.zero_()
    else:
        accepted = 0
        for j in range(rows.shape[0]):
            if not m.is_terminated():
                m.fill_next_token_bitmask(bm, j)
            else:
                bm[j].zero_()
            if j < len(proposal) and m.accept_token(proposal[j]):
                accepted += 1
        if accepted:
            m.rollback(accepted)
    xgr.apply_token_bitmask_inplace(rows, bm)
