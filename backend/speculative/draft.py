"""Draft-engine proposer: another engine with the target's vocabulary (e.g. the int4 build of the
same model, or a smaller model of the same family) proposes k tokens per sequence by running k
decode steps of its own, over its own paged KV cache (ModelRunner + BlockManager, no prefix
caching). Leviathan et al. (2023) / Chen et al. (2023), section "draft model".

Each target sequence has a shadow here: the same token ids, the draft's own blocks and computed
count. Before proposing, the shadow catches up with the target (after a verification, its K/V is
kept up to the longest common prefix of what it drafted and what the target accepted; the first
draft step then computes the missing tokens: the whole prompt for a new sequence). Draft tokens
are chosen as the target would choose them (the same bans, penalties, temperature and top-k/p,
min-p): the argmax for greedy requests; for sampling requests a sample from the draft's
processed distribution q, drawn from the sequence's own generator, with q kept for verification.
"""
from __future__ import annotations

from typing import Dict, List

import torch

from ..block_manager import BlockManager
from ..model_runner import ModelRunner
from ..placement import bind_thread
from ..sampler import draw, probabilities, processed_logits
from ..scheduler import SchedulerOutput
from .verify import SeqView


def check_same_vocabulary(draft_cfg, draft_tok, target_cfg, target_tok) -> None:
    """Raise ValueError unless the draft can propose token ids the target reads the same way."""
    dv, tv = draft_cfg.model.vocab_size, target_cfg.model.vocab_size
    if dv != tv:
        raise ValueError(f"draft engine has a vocabulary of {dv} tokens, the target engine {tv}: a draft "
                         f"engine must use the target's tokenizer (e.g. another build of the same model)")
    if (draft_tok is None) != (target_tok is None):
        raise ValueError("draft engine and target engine must both have a tokenizer or both have none")
    if draft_tok is not None:
        d, t = draft_tok.get_vocab(with_added_tokens=True), target_tok.get_vocab(with_added_tokens=True)
        if d != t:
            diff = sorted(set(d.items()) ^ set(t.items()), key=lambda kv: kv[1])[0]
            raise ValueError(f"draft engine's tokenizer differs from the target's (first difference: token "
                             f"{diff[0]!r} -> id {diff[1]} in only one of them); a draft engine must use the "
                             f"target's tokenizer")


class _Shadow:
    """The draft's copy of one target sequence (what ModelRunner and BlockManager read)."""
    __slots__ = ("target", "token_ids", "num_computed_tokens", "block_table", "block_hashes", "spec_token_ids",
                 "synced")

    def __init__(self, target):
        self.target = target
        self.token_ids: List[int] = []
        self.num_computed_tokens = 0
        self.block_table: List[int] = []
        self.block_hashes: List[bytes] = []
        self.spec_token_ids: List[int] = []
        self.synced = 0  # token_ids[:synced] are known to equal the target's

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class DraftProposer:
    def __init__(self, cfg, model, tokenizer, target_cfg, target_tokenizer, device, num_kv_blocks: int):
        check_same_vocabulary(cfg, tokenizer, target_cfg, target_tokenizer)
        self.cfg = cfg
        bind_thread(device)  # the draft runs in the engine's thread: same device as the target
        self.runner = ModelRunner(cfg, model, num_kv_blocks, device)
        self.bm = BlockManager(num_kv_blocks, cfg.limits.block_size, enable_prefix_caching=False)
        self.max_seq_len = cfg.limits.max_seq_len  # longer sequences are not speculated
        self.shadows: Dict[int, _Shadow] = {}  # target seq_id -> shadow

    def release_finished(self) -> None:
        """Free the shadows of finished (or aborted) target sequences."""
        for sid in [sid for sid, sh in self.shadows.items() if sh.target.is_finished]:
            self._drop(sid)

    def _drop(self, sid: int) -> None:
        sh = self.shadows.pop(sid)
        if sh.block_table:
            self.bm.free(sh)

    def _sync(self, sh: _Shadow) -> None:
        """Make sh's tokens the target's; keep K/V only for the common prefix."""
        tgt = sh.target.token_ids
        c, n = sh.synced, min(len(sh.token_ids), len(tgt))
        while c < n and sh.token_ids[c] == tgt[c]:
            c += 1
        sh.token_ids = list(tgt)
        sh.synced = len(tgt)
        c = min(c, len(tgt) - 1)  # the last token is always computed again: its logits draft the next
        if sh.num_computed_tokens > c:
            self.bm.truncate(sh, c)

    def _reserve(self, sh: _Shadow, num_new: int) -> bool:
        if not sh.block_table:
            if not self.bm.can_allocate(sh, num_new, []):
                return False
            self.bm.allocate(sh, num_new, [])
            return True
        if not self.bm.can_append(sh, num_new):
            return False
        copies = self.bm.append_slots(sh, num_new)
        assert not copies  # shadows never share blocks
        return True

    @torch.inference_mode()
    def propose(self, seqs, ks: List[int]) -> int:
        """Set seq.spec_token_ids (and spec_draft_probs for sampling requests) for each seq, up to
        ks[i] tokens. Returns the number of draft forward passes run."""
        active = []
        for seq, k in zip(seqs, ks):
            if k <= 0 or seq.num_tokens + k > self.max_seq_len:
                continue
            sh = self.shadows.get(seq.seq_id)
            if sh is None:
                sh = self.shadows[seq.seq_id] = _Shadow(seq)
            self._sync(sh)
            if not self._reserve(sh, sh.num_tokens - sh.num_computed_tokens + k - 1):
                self._drop(seq.seq_id)  # the draft's pool is full: no proposal this step
                continue
            active.append((seq, sh, k))
        drafts: Dict[int, List[int]] = {seq.seq_id: [] for seq, _, _ in active}
        qs: Dict[int, List[torch.Tensor]] = {seq.seq_id: [] for seq, _, _ in active}
        steps = 0
        while True:
            rows = [(seq, sh) for seq, sh, k in active if len(drafts[seq.seq_id]) < k]
            if not rows:
                break
            sched = SchedulerOutput(seqs=[sh for _, sh in rows],
                                    num_new_tokens=[sh.num_tokens - sh.num_computed_tokens for _, sh in rows])
            logits = self.runner.run(sched)
            steps += 1
            for (_, sh), n in zip(rows, sched.num_new_tokens):
                sh.num_computed_tokens += n
            views = [SeqView(seq, drafts[seq.seq_id]) for seq, _ in rows]
            x = processed_logits(logits, views)
            tokens = x.max(dim=-1).indices.tolist()
            sampling = [i for i, (seq, _) in enumerate(rows) if not seq.request.params.is_greedy]
            if sampling:
                probs = probabilities(x[sampling], [rows[i][0].request.params for i in sampling])
                for j, i in enumerate(sampling):
                    seq = rows[i][0]
                    tokens[i] = draw(probs[j], seq.generator)
                    qs[seq.seq_id].append(probs[j])
            for (seq, sh), tok in zip(rows, tokens):
                drafts[seq.seq_id].append(tok)
                sh.token_ids.append(tok)
        for seq, _, _ in active:
            seq.spec_token_ids = drafts[seq.seq_id]
            q = qs[seq.seq_id]
            seq.spec_draft_probs = torch.stack(q) if q else None
        return steps
