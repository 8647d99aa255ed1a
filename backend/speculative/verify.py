"""Verification of proposed tokens against the target's logits.

A speculating sequence of L tokens with proposal s_1..s_k gets k + 1 rows of target logits from
one forward: row j is the target's next-token distribution after s_1..s_j. Each row is processed
exactly as the sampler would process it for the sequence extended by s_1..s_j (bans, min_tokens,
penalties, temperature, top-k/top-p/min-p; backend/sampler.py), so the output follows the target
whatever the proposal.

- Greedy (temperature 0): accept the longest prefix of the proposal equal to the target's argmax,
  then emit the target's argmax at the first mismatch (or after the last proposed token). The
  tokens are those of plain greedy decoding.
- Sampling: speculative sampling (Leviathan, Kalman and Matias, "Fast Inference from Transformers
  via Speculative Decoding", ICML 2023; Chen et al., "Accelerating Large Language Model Decoding
  with Speculative Sampling", 2023). With target probabilities p_j and draft probabilities q_j
  (for a deterministic proposer such as the n-gram lookup, q_j is a point mass on s_{j+1}):
  accept s_{j+1} with probability min(1, p_j(s_{j+1}) / q_j(s_{j+1})); at the first rejection
  emit a sample of norm(max(0, p_j - q_j)) and stop; when all k are accepted emit a sample of p_k.
  Each emitted token is then distributed exactly as the target's.
Random draws come from the sequence's own generator (one uniform per checked token, one
vocabulary-sized exponential draw per emitted sample), so seeded requests stay reproducible.
Logprobs are the target's raw log-softmax of each emitted token's row.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch

from ..guided.state import mask_proposal_rows
from ..random_stream import SeedStream
from ..sampler import draw, logprob_entry, probabilities, processed_logits


class SeqView:
    """A sequence as it would be with `extra` tokens appended (what the sampler reads of it)."""
    __slots__ = ("request", "token_ids", "num_prompt_tokens", "generator")

    def __init__(self, seq, extra: List[int]):
        self.request = seq.request
        self.token_ids = seq.token_ids + list(extra) if extra else seq.token_ids
        self.num_prompt_tokens = seq.num_prompt_tokens
        self.generator = seq.generator

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> List[int]:
        return self.token_ids[self.num_prompt_tokens:]


def processed_rows(logits: torch.Tensor, seq, tokens: List[int]) -> torch.Tensor:
    """Row j of `logits` processed (steps 1-3) for seq extended by tokens[:j]."""
    return processed_logits(logits, [SeqView(seq, tokens[:j]) for j in range(logits.shape[0])])


def uniform(generator) -> float:
    """One Uniform(0, 1) from the sequence's SeedStream (or a torch.Generator, or torch's default)."""
    if isinstance(generator, SeedStream):
        return generator.uniform()
    return float(torch.rand((), generator=generator))


def speculative_sampling(p: torch.Tensor, proposal: List[int], q: Optional[torch.Tensor],
                         generator: Optional[torch.Generator]) -> List[int]:
    """Leviathan et al. / Chen et al.: p (k+1, V) target probs, q (k, V) draft probs or None for a
    point mass on each proposed token. Returns the accepted prefix plus one emitted token."""
    for j, x in enumerate(proposal):
        qx = 1.0 if q is None else float(q[j, x])
        px = float(p[j, x])
        if uniform(generator) * qx < px:  # u < p(x) / q(x): accept with probability min(1, p/q)
            continue
        if q is None:
            residual = p[j].clone()
            residual[x] = 0.0
        else:
            residual = (p[j] - q[j]).clamp_min(0.0)
        if not float(residual.sum()) > 0.0:  # p == q up to rounding: nothing is left to correct
            residual = p[j]
        return proposal[:j] + [draw(residual, generator)]
    return list(proposal) + [draw(p[len(proposal)], generator)]


AcceptRule = Callable[[torch.Tensor, List[int], Optional[torch.Tensor], Optional[torch.Generator]], List[int]]


def verify(logits: torch.Tensor, seq, proposal: List[int], draft_probs: Optional[torch.Tensor] = None,
           rule: AcceptRule = speculative_sampling) -> Tuple[List[int], List[Optional[dict]]]:
    """logits (k+1, V) float32 rows of the target for seq and its proposal (k tokens).

    Returns (tokens to append: accepted proposal prefix + one token from the target, logprob
    entries or None per token)."""
    params = seq.request.params
    mask_proposal_rows(logits, seq, proposal)  # structured outputs: row j under the grammar after s_1..s_j
    x = processed_rows(logits, seq, proposal)
    if params.is_greedy:
        target = x.max(dim=-1).indices.tolist()
        a = 0
        while a < len(proposal) and proposal[a] == target[a]:
            a += 1
        tokens = list(proposal[:a]) + [target[a]]
    else:
        p = probabilities(x, [params] * x.shape[0])
        tokens = rule(p, list(proposal), draft_probs, seq.generator)
    if params.logprobs is None:
        return tokens, [None] * len(tokens)
    raw_lp = torch.log_softmax(logits[:len(tokens)], dim=-1)
    return tokens, [logprob_entry(raw_lp[j], t, params.logprobs) for j, t in enumerate(tokens)]
