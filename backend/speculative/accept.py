"""After the forward: verify each proposal, roll back the rejected tokens' K/V, append the rest.

Called by LLMEngine.postprocess for the sequences that ran 1 + k tokens this step. verify.verify
accepts a prefix of the proposal (greedy: the target's argmax; sampling: the rejection rule of
Leviathan et al. / Chen et al., 2023) and adds one token of the target's own; the K/V of the
rejected proposals is dropped with BlockManager.truncate, so the cache holds exactly the tokens
of the sequence.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch

from .verify import AcceptRule, verify


def accept_proposals(verifying: List[tuple], logits: torch.Tensor, block_manager, rule: AcceptRule,
                     append: Callable[[object, int, Optional[dict]], None]) -> Tuple[int, int]:
    """verifying: (seq, first logits row) per sequence; logits rows row .. row + k belong to it.
    append(seq, token, logprob entry) appends one token (and finishes seq when it ends it).
    Returns (proposed, accepted) token counts."""
    proposed = accepted = 0
    with torch.inference_mode():
        for seq, row in verifying:
            proposal, q = seq.spec_token_ids, seq.spec_draft_probs
            k = len(proposal)
            seq.spec_token_ids, seq.spec_draft_probs = [], None
            rows = logits[row:row + k + 1]
            if rows.device.type != "cpu":  # device-sampling runner: verification reads its rows on the host
                rows = rows.cpu()
            tokens, entries = verify(rows, seq, proposal, q, rule)
            a = len(tokens) - 1
            proposed += k
            accepted += a
            seq.request.metrics.num_spec_proposed_tokens += k
            seq.request.metrics.num_spec_accepted_tokens += a
            # K/V is valid for token_ids and the accepted proposal; the rest is rolled back.
            seq.num_computed_tokens = seq.num_tokens + k
            block_manager.truncate(seq, seq.num_tokens + a)
            for tok, entry in zip(tokens, entries):
                append(seq, tok, entry)
                if seq.is_finished:
                    break
            if not seq.is_finished:
                block_manager.cache_full_blocks(seq)
    return proposed, accepted
