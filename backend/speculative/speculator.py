"""The engine's speculative-decoding step: propose before scheduling, verify after the forward.

Per engine step (LLMEngine.step):
  1. propose(): every running sequence that is decoding (one token left to compute) may get a
     proposal of up to k tokens in seq.spec_token_ids (and the draft's probabilities);
  2. the scheduler gives it 1 + k tokens of the step's budget; the runner computes them with the
     other decodes and prefill chunks in one forward and returns k + 1 logits rows for it;
  3. postprocess calls verify.verify(); the accepted tokens plus one from the target are
     appended and the K/V of rejected proposals is rolled back (BlockManager.truncate).

Switch-off rule (measured; docs/speculative.md): a step of T tokens costs about a + b*T. With B
sequences in the batch, acceptance rate alpha (accepted / proposed tokens, a running average)
and a draft forward costing rho target forwards per proposed position (0 for the n-gram lookup),
speculating wins iff  B * (1 - alpha + rho) < (alpha - rho) * r,  r = a / b
(SpeculativeConfig.step_overhead_tokens). Otherwise the step runs plain decodes; with the n-gram
lookup one step in PROBE_PERIOD speculates anyway so alpha keeps tracking the traffic (a draft
does not probe: catching up would prefill every prompt in the draft). Seeded sampling requests
always speculate (when they have a proposal), so their tokens depend only on their seed and
history, never on the rest of the batch.
"""
from __future__ import annotations

import time
from typing import Optional

from ..block_manager import cdiv
from ..guided.state import trim_proposals
from ..loader import load_engine
from .config import SpeculativeConfig
from .draft import DraftProposer
from .ngram import ngram_propose
from .verify import AcceptRule, speculative_sampling

PROBE_PERIOD = 32
EMA = 0.05           # weight of the newest step in the running averages
ALPHA_PRIOR = 0.5    # acceptance rate assumed before any measurement


def make_speculator(config: SpeculativeConfig, target_config, target_tokenizer, device, num_target_tokens: int,
                    max_num_seqs: int, draft_engine=None, loaded_draft=None) -> "Speculator":
    """A Speculator for a target engine. Method "draft" loads config.draft_engine_dir, or takes
    draft_engine's loaded model (an LLMEngine), as the proposer; it must share the target's
    vocabulary. num_target_tokens: the tokens the target's KV pool holds (the draft's pool gets
    room for as many, plus k per sequence, unless config.draft_num_kv_blocks says otherwise)."""
    config.validate()
    if config.method != "draft":
        return Speculator(config)
    if loaded_draft is not None:  # (cfg, model, tokenizer), loaded by the engine for its memory budget
        dcfg, dmodel, dtok = loaded_draft
    elif draft_engine is None:
        dcfg, dmodel, dtok = load_engine(config.draft_engine_dir, str(device))
    else:
        dcfg, dmodel, dtok = draft_engine.config, draft_engine.runner.model, draft_engine.tokenizer
    if dcfg.tensor_parallel_size > 1:
        raise ValueError("the draft engine must be a single-rank engine (tensor_parallel_size 1), "
                         f"got tensor_parallel_size {dcfg.tensor_parallel_size}")
    num_blocks = config.draft_num_kv_blocks
    if num_blocks is None:
        bs = dcfg.limits.block_size
        num_blocks = cdiv(num_target_tokens, bs) + max_num_seqs * cdiv(config.num_speculative_tokens, bs)
    return Speculator(config, DraftProposer(dcfg, dmodel, dtok, target_config, target_tokenizer, device, num_blocks))


class Speculator:
    def __init__(self, config: SpeculativeConfig, draft=None):
        self.config = config.validate()
        self.draft = draft  # DraftProposer for method "draft"
        self.rule: AcceptRule = speculative_sampling
        self.alpha = ALPHA_PRIOR
        self.rho = 0.0       # draft forward / target forward (time), measured
        self._target_step_s: Optional[float] = None
        self._steps_off = 0
        self.num_proposed = 0   # tokens proposed and verified
        self.num_accepted = 0   # of those, accepted
        self.num_verify_rows = 0  # sequence-steps that verified a proposal
        self.num_steps_on = 0
        self.num_steps_off = 0  # steps whose decodes did not speculate by the switch-off rule

    # ------------------------------------------------------------------ the rule
    def should_speculate(self, batch: int) -> bool:
        r = self.config.step_overhead_tokens
        if r == float("inf"):
            return True
        a, rho = self.alpha, self.rho
        return batch * (1.0 - a + rho) < (a - rho) * r

    # ------------------------------------------------------------------ 1. propose
    def propose(self, running, max_seq_len: int) -> None:
        """Set spec_token_ids (and spec_draft_probs) of the running sequences that speculate this step."""
        self._propose(running, max_seq_len)
        trim_proposals(running)  # structured outputs: cut at the first token the grammar rejects

    def _propose(self, running, max_seq_len: int) -> None:
        for seq in running:
            seq.spec_token_ids, seq.spec_draft_probs = [], None
        # Decoding sequences: one token left to compute and past the prompt (the step that
        # completes a prompt samples the first token and forks n > 1 samples; it never speculates).
        cands = [s for s in running if s.num_tokens - s.num_computed_tokens == 1 and s.num_output_tokens > 0]
        if self.draft is not None:
            self.draft.release_finished()
        if not cands:
            return
        if self.should_speculate(len(running)):
            self._steps_off = 0
            self.num_steps_on += 1
        else:
            self._steps_off += 1
            # Probe steps keep alpha current; the draft never probes (its first proposal for a
            # sequence prefills the whole prompt in the draft), it resumes when the batch shrinks.
            if self._steps_off < PROBE_PERIOD or self.draft is not None:
                self.num_steps_off += 1
                cands = [s for s in cands if s.generator is not None and not s.request.params.is_greedy]
                if not cands:
                    return
            else:
                self._steps_off = 0
        k_max = self.config.num_speculative_tokens
        ks = []
        for s in cands:
            p = s.request.params
            # Never past max_tokens (the emitted token comes on top) nor the engine's max_seq_len.
            ks.append(max(0, min(k_max, p.max_tokens - s.num_output_tokens - 1, max_seq_len - s.num_tokens)))
        if self.draft is not None:
            t0 = time.perf_counter()
            steps = self.draft.propose(cands, ks)
            if steps and self._target_step_s:
                per_step = (time.perf_counter() - t0) / steps
                self.rho = (1 - EMA) * self.rho + EMA * per_step / self._target_step_s
            return
        c = self.config
        for s, k in zip(cands, ks):
            if k:
                s.spec_token_ids = ngram_propose(s.token_ids, k, c.ngram_min, c.ngram_max)

    # ------------------------------------------------------------------ 3. verify (bookkeeping)
    def observe_step(self, seconds: float, num_seqs: int, num_tokens: int, proposed: int, accepted: int) -> None:
        """After a step: its forward time and the proposal outcome, for the running averages.
        The step time is scaled to what a plain decode step of the same sequences would take
        under the cost model (a + b * tokens), so that rho compares like with like."""
        r = self.config.step_overhead_tokens
        plain = seconds if r == float("inf") else seconds * (r + num_seqs) / (r + num_tokens)
        self._target_step_s = plain if self._target_step_s is None else \
            (1 - EMA) * self._target_step_s + EMA * plain
        if proposed:
            self.num_proposed += proposed
            self.num_accepted += accepted
            self.alpha = (1 - EMA) * self.alpha + EMA * accepted / proposed

    def stats(self) -> dict:
        return {"spec_method": self.config.method, "spec_proposed_tokens": self.num_proposed,
                "spec_accepted_tokens": self.num_accepted, "spec_verify_rows": self.num_verify_rows,
                "spec_acceptance_rate": self.num_accepted / self.num_proposed if self.num_proposed else 0.0,
                "spec_steps_on": self.num_steps_on, "spec_steps_off": self.num_steps_off}
