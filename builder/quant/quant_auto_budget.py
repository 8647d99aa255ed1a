"""The texts `--quantization auto` checks its perplexity budget on, and the margin it keeps.

A budget checked on one text holds on that text: a build checked on the stdlib docstrings alone
met +0.5% there and scored +0.63% on held-out State of the Union prose. So the check scores a
mix of four domains (the docstrings, and the prose, dialogue and code domains the calibration
mix is drawn from), takes the *worst* domain's increase, and accepts a rung only when that worst
increase is at most (1 - AUTO_BUDGET_MARGIN) of the budget. The held-out domains of the build
report (kjv, devil) stay out of the check, so they remain an independent score of the plan.

Margin: on SmolLM2-135M (int4-rtn candidates), the spread between the best- and worst-scoring
domain of a rung was up to ~1.3x, the same ratio as docstrings vs State of the Union above;
0.25 of the budget keeps the worst checked domain at 0.75 of it, so an unseen domain up to
1.33x worse than it still meets the budget (docs/quantization.md, quality budget).
"""
from __future__ import annotations

from typing import Dict, List, Sequence

from ..calibration_mix import domain_text
from .quant_eval import encode_text

BUDGET_DOMAINS = ("docstrings", "prose", "dialogue", "code")
AUTO_BUDGET_MARGIN = 0.25


def budget_texts(tokenizer, num_tokens: int, chat_template=None) -> Dict[str, List[int]]:
    """domain -> the first num_tokens token ids of each BUDGET_DOMAINS text."""
    return {d: encode_text(tokenizer, domain_text(d, chat_template), num_tokens) for d in BUDGET_DOMAINS}


def accept_threshold(budget: float) -> float:
    """The largest worst-domain increase (a fraction) a rung may measure to be accepted."""
    return budget * (1.0 - AUTO_BUDGET_MARGIN)


def worst(per_domain: Dict[str, float]) -> float:
    return max(per_domain.values())


def describe(per_domain: Dict[str, float], budget: float, tokens: Sequence[int]) -> dict:
    """The build report's record of a budget check: each domain's increase (percent), the worst,
    the threshold and the margin left to the budget."""
    w = worst(per_domain)
    return {"domains": {d: round(100 * v, 4) for d, v in per_domain.items()},
            "tokens_per_domain": list(tokens), "worst_domain": max(per_domain, key=per_domain.get),
            "worst_ppl_increase_pct": 100 * w, "accept_below_pct": 100 * accept_threshold(budget),
            "margin_pct": 100 * (budget - w), "margin_fraction_of_budget": AUTO_BUDGET_MARGIN}
