"""SpeculativeConfig: which proposer, how many tokens, and the switch-off rule's constants."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

METHODS = ("ngram", "draft")
MAX_SPECULATIVE_TOKENS = 16
DEFAULT_NUM_SPECULATIVE_TOKENS = 4
# Cost of one engine step's fixed part (weights read once, per-layer launches, Python) in units of
# the cost of one more token in the batch: step_time(T tokens) ~ a + b * T, this is a / b.
# Measured for SmolLM2-135M bf16 on this 2-core host (docs/speculative.md, "switch-off rule").
DEFAULT_STEP_OVERHEAD_TOKENS = 16.0


@dataclass
class SpeculativeConfig:
    """method: "ngram" (prompt lookup) or "draft" (draft_engine_dir: an engine with the same vocabulary).

    num_speculative_tokens: tokens proposed per sequence and step (k). ngram_min / ngram_max: the
    n-gram lengths the lookup tries, longest first. step_overhead_tokens: the switch-off rule's
    a / b (see Speculator.should_speculate); 0 never switches off.
    """
    method: str
    num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS
    draft_engine_dir: Optional[str] = None
    ngram_min: int = 1
    ngram_max: int = 4
    step_overhead_tokens: float = DEFAULT_STEP_OVERHEAD_TOKENS
    draft_num_kv_blocks: Optional[int] = None

    def validate(self) -> "SpeculativeConfig":
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(METHODS)}, got {self.method!r}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        for name in ("ngram_min", "ngram_max"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) must be <= ngram_max ({self.ngram_max})")
        if self.method == "draft" and not self.draft_engine_dir:
            raise ValueError("speculative method 'draft' needs draft_engine_dir (the draft engine's directory)")
        if self.method == "ngram" and self.draft_engine_dir:
            raise ValueError("draft_engine_dir is only used with speculative method 'draft', not 'ngram'")
        r = self.step_overhead_tokens
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not r >= 0:
            raise ValueError(f"step_overhead_tokens must be a number >= 0, got {r!r}")
        return self
