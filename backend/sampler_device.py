"""DeviceSampler: the sampler of sampler.py run batched on the logits' device.

Same definitions and order as backend/sampler.py (its docstring is the specification), with
the work shaped for a GPU: one batched op per step instead of a loop per row, no
full-vocabulary sort, and only the chosen ids and the requested logprobs copied back to the
host (one small transfer per step).

- Bans and logit bias: the (row, token) pairs are gathered on the host (they are short lists)
  and applied with one index_put each.
- Penalties: seen-token masks and output-token counts are scattered on the device from the
  padded token lists of the rows that ask for a penalty.
- Top-k: torch.topk of the largest k of the batch, already sorted, so when every sampling row
  has a top-k, top-p and min-p run on those k candidates exactly as the host sampler does on its
  sorted row. Otherwise top-k is a threshold (the k-th largest value) and top-p a threshold
  search: the smallest probability t whose strictly-larger mass is still below p is found by
  bisection over the float's bit pattern (30 masked sums per row, no sort); Holtzman et al.'s
  nucleus is then {i : p_i >= t}. Min-p (Nguyen et al.) is a threshold on the row maximum.
- Draw: the exponential race of sampler.py with the same streams: seeded rows take their
  SeedStream's noise (computed on the device, at the candidates only on the top-k path), the
  others torch's default generator of the device, one (rows, V) draw as on the host.
The only ties that can part the two samplers are exact float ties at a top-k boundary (kept
together here) and rounding of a top-p mass that lands within an ulp of p.
"""
from __future__ import annotations

from typing import List, Optional, Sequence as Seq, Tuple

import torch

from .guided.state import mask_logits
from .random_stream import SeedStream, exponential_at, id_hash
from .sampler import NEG_INF, tempered

_ONE_BITS = 0x3F800000  # float32 1.0 as int32
_BISECT_STEPS = 30      # ceil(log2(_ONE_BITS)): the search interval shrinks to adjacent floats


def _to(dev, values, dtype) -> torch.Tensor:
    """A small host list as a tensor on `dev` (pinned + non_blocking on CUDA)."""
    t = torch.tensor(values, dtype=dtype)
    if dev.type == "cuda":
        return t.pin_memory().to(dev, non_blocking=True)
    return t


def _padded(dev, lists: List[List[int]], pad: int) -> torch.Tensor:
    width = max((len(x) for x in lists), default=0) or 1
    return _to(dev, [list(x) + [pad] * (width - len(x)) for x in lists], torch.int64)


def apply_bans_device(x: torch.Tensor, seqs: Seq) -> None:
    """Step 1 in place: min_tokens and bad-word bans, then logit_bias, as batched index_puts."""
    dev = x.device
    rows: List[torch.Tensor] = []
    toks: List[torch.Tensor] = []
    b_rows: List[int] = []
    b_toks: List[int] = []
    b_vals: List[float] = []
    for r, seq in enumerate(seqs):
        req = seq.request
        banned = []
        if req.min_tokens_bans is not None and seq.num_output_tokens < req.params.min_tokens:
            banned.append(req.min_tokens_bans)
        if req.bad_words.always is not None:
            banned.append(req.bad_words.always)
        ctx = req.bad_words.context_bans(seq.token_ids)
        if ctx:
            banned.append(torch.tensor(ctx, dtype=torch.long))
        for t in banned:
            toks.append(t)
            rows.append(torch.full((t.numel(),), r, dtype=torch.long))
        for t, b in (req.params.logit_bias or {}).items():
            b_rows.append(r)
            b_toks.append(int(t))
            b_vals.append(float(b))
    if toks:
        idx = torch.stack([torch.cat(rows), torch.cat(toks)])
        idx = idx.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else idx
        x.index_put_((idx[0], idx[1]), torch.full((), NEG_INF, dtype=x.dtype, device=dev))
    if b_rows:
        bi = _to(dev, [b_rows, b_toks], torch.int64)
        x.index_put_((bi[0], bi[1]), _to(dev, b_vals, torch.float32).to(x.dtype), accumulate=True)


def apply_penalties_device(x: torch.Tensor, seqs: Seq) -> None:
    """Steps 2-3 in place for the rows that ask for a penalty (formulas in sampler.py)."""
    dev, vocab = x.device, x.shape[1]
    params = [s.request.params for s in seqs]
    rep = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if rep:
        ri = _to(dev, rep, torch.int64)
        seen = torch.zeros(len(rep), vocab + 1, dtype=torch.bool, device=dev)
        seen.scatter_(1, _padded(dev, [seqs[i].token_ids for i in rep], vocab), True)
        r = _to(dev, [params[i].repetition_penalty for i in rep], torch.float32)[:, None].to(x.dtype)
        row = x.index_select(0, ri)
        penalized = torch.where(row > 0, row / r, row * r)
        x.index_copy_(0, ri, torch.where(seen[:, :vocab], penalized, row))
    pf = [i for i, p in enumerate(params) if (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0)
          and seqs[i].output_token_ids]
    if pf:
        pi = _to(dev, pf, torch.int64)
        counts = torch.zeros(len(pf), vocab + 1, dtype=x.dtype, device=dev)
        out = _padded(dev, [seqs[i].output_token_ids for i in pf], vocab)
        counts.scatter_add_(1, out, torch.ones(out.shape, dtype=x.dtype, device=dev))
        counts = counts[:, :vocab]
        fp = _to(dev, [params[i].frequency_penalty for i in pf], torch.float32)[:, None].to(x.dtype)
        pp = _to(dev, [params[i].presence_penalty for i in pf], torch.float32)[:, None].to(x.dtype)
        x.index_copy_(0, pi, x.index_select(0, pi) - (fp * counts + pp * (counts > 0).to(x.dtype)))


def processed_logits_device(logits: torch.Tensor, seqs: Seq) -> torch.Tensor:
    """Steps 1-3 on a copy when any row needs them (else `logits` itself)."""
    params = [s.request.params for s in seqs]
    need_bans = any(p.min_tokens or p.logit_bias or s.request.bad_words for p, s in zip(params, seqs))
    need_penalties = any(p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
                         for p in params)
    if not (need_bans or need_penalties):
        return logits
    x = logits.clone()
    if need_bans:
        apply_bans_device(x, seqs)
    if need_penalties:
        apply_penalties_device(x, seqs)
    return x


def top_p_threshold(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row, the smallest float t with sum(p_j : p_j > t) < top_p, by bisection over the bit
    pattern of non-negative floats (monotone as int32). Holtzman et al.'s nucleus is p_i >= t:
    a token stays while the mass ranked above it is below p. probs (R, V) float32; (R,) -> (R,)."""
    n = probs.shape[0]
    lo = torch.zeros(n, dtype=torch.int32, device=probs.device)       # mass above: >= p
    hi = torch.full((n,), _ONE_BITS, dtype=torch.int32, device=probs.device)  # mass above 1.0: 0 < p
    for _ in range(_BISECT_STEPS):
        mid = lo + (hi - lo) // 2
        t = mid.view(torch.float32)[:, None]
        above = torch.where(probs > t, probs, torch.zeros((), dtype=probs.dtype, device=probs.device)).sum(-1)
        ok = above < top_p
        hi = torch.where(ok, mid, hi)
        lo = torch.where(ok, lo, mid)
    return hi.view(torch.float32)


def _min_p_mask(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = x.softmax(dim=-1)
    thresh = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return x.masked_fill(probs < thresh, NEG_INF)


def _noise(seqs: Seq, vocab: int, dev, cand: Optional[torch.Tensor]) -> torch.Tensor:
    """Exp(1) noise per row, (R, V), or at the candidate ids cand (R, K): unseeded rows from the
    device's default generator (one (rows, V) draw, as the host sampler does), seeded rows from
    their SeedStream."""
    n = len(seqs)
    width = vocab if cand is None else cand.shape[1]
    noise = torch.empty(n, width, device=dev)
    unseeded = [j for j, s in enumerate(seqs) if not isinstance(s.generator, SeedStream)]
    seeded = [j for j, s in enumerate(seqs) if isinstance(s.generator, SeedStream)]
    if unseeded:
        gens = {id(seqs[j].generator) for j in unseeded}
        if gens != {id(None)}:
            raise TypeError("DeviceSampler draws seeded rows from SeedStreams only")
        full = torch.empty(len(unseeded), vocab, device=dev).exponential_()
        ui = _to(dev, unseeded, torch.int64)
        noise.index_copy_(0, ui, full if cand is None else full.gather(1, cand.index_select(0, ui)))
    if seeded:
        si = _to(dev, seeded, torch.int64)
        keys = _to(dev, [seqs[j].generator.next_key() for j in seeded], torch.int64)
        hashed = id_hash(vocab, dev)
        ids = hashed if cand is None else hashed[cand.index_select(0, si)]
        noise.index_copy_(0, si, exponential_at(keys, ids))
    return noise


def sample_rows(x: torch.Tensor, seqs: Seq) -> torch.Tensor:
    """Steps 4-6 for processed rows x (R, V) whose params sample (temperature > 0): (R,) token ids
    on the device."""
    dev, (n, vocab) = x.device, x.shape
    params = [s.request.params for s in seqs]
    ks = [min(max(p.top_k or 0, 0), vocab) for p in params]
    xs = tempered(x, _to(dev, [p.temperature for p in params], torch.float32))
    top_p = _to(dev, [p.top_p for p in params], torch.float32)
    min_p = _to(dev, [p.min_p for p in params], torch.float32)
    any_min_p = any(p.min_p > 0 for p in params)
    if all(k > 0 for k in ks):
        # Every row has a top-k: work on the k_max sorted candidates, as sampler.truncate does on
        # its sorted row (rank >= k dropped, then the mass before a token against p).
        kmax = max(ks)
        vals, idx = xs.topk(kmax, dim=-1)
        k = _to(dev, ks, torch.int64)
        drop = torch.arange(kmax, device=dev)[None, :] >= k[:, None]
        vals = vals.masked_fill(drop, NEG_INF)
        probs = vals.softmax(dim=-1)
        drop |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
        drop[:, 0] = False
        vals = vals.masked_fill(drop, NEG_INF)
        if any_min_p:
            vals = _min_p_mask(vals, min_p)
        choice = (vals.softmax(dim=-1) / _noise(seqs, vocab, dev, idx).clamp_min(1e-20)).max(dim=-1).indices
        return idx.gather(1, choice[:, None])[:, 0]
    if any(k > 0 for k in ks):
        kmax = max(ks)
        kth_idx = _to(dev, [max(k, 1) - 1 for k in ks], torch.int64)[:, None]
        kth = xs.topk(kmax, dim=-1).values.gather(1, kth_idx)
        kth = torch.where(_to(dev, ks, torch.int64)[:, None] > 0, kth, torch.full_like(kth, NEG_INF))
        xs = xs.masked_fill(xs < kth, NEG_INF)
    if any(p.top_p < 1.0 for p in params):
        probs = xs.softmax(dim=-1)
        t = top_p_threshold(probs, top_p)
        t = torch.where(top_p < 1.0, t, torch.zeros_like(t))
        xs = xs.masked_fill(probs < t[:, None], NEG_INF)
    if any_min_p:
        xs = _min_p_mask(xs, min_p)
    return (xs.softmax(dim=-1) / _noise(seqs, vocab, dev, None).clamp_min(1e-20)).max(dim=-1).indices


class DeviceSampler:
    """Samples one token per row on the logits' device; sampler.Sampler's contract."""

    def __call__(self, logits: torch.Tensor, seqs: Seq) -> Tuple[List[int], List[Optional[dict]]]:
        """logits: float32 (N, V) on any device, one row per sequence in `seqs`.
        Returns (token ids, logprob entries or None per row), like Sampler."""
        n, vocab = logits.shape
        dev = logits.device
        mask_logits(logits, seqs)  # structured outputs first (backend/guided/)
        params = [s.request.params for s in seqs]
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw_lp = torch.log_softmax(logits.index_select(0, _to(dev, lp_rows, torch.int64)), dim=-1) \
            if lp_rows else None
        x = processed_logits_device(logits, seqs)
        tokens = x.max(dim=-1).indices
        rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if rows:
            ri = _to(dev, rows, torch.int64)
            tokens.index_copy_(0, ri, sample_rows(x.index_select(0, ri), [seqs[i] for i in rows]))
        # One device -> host copy: the ids, then per logprob row its token's logprob and top-n.
        parts = [tokens.to(torch.float64)]
        num_top = max((params[i].logprobs for i in lp_rows), default=0)
        if raw_lp is not None:
            chosen = raw_lp.gather(1, tokens.index_select(0, _to(dev, lp_rows, torch.int64))[:, None])
            parts.append(chosen[:, 0].to(torch.float64))
            if num_top > 0:
                top_v, top_i = raw_lp.topk(num_top, dim=-1)
                parts += [top_v.flatten().to(torch.float64), top_i.flatten().to(torch.float64)]
        host = torch.cat(parts).cpu().tolist()
        token_list = [int(t) for t in host[:n]]
        entries: List[Optional[dict]] = [None] * n
        r = len(lp_rows)
        for j, i in enumerate(lp_rows):
            want = params[i].logprobs
            entry = {"token_id": token_list[i], "logprob": host[n + j], "top_logprobs": []}
            if want > 0:
                base = n + r + j * num_top
                ids_at = n + r + r * num_top + j * num_top
                entry["top_logprobs"] = [{"token_id": int(host[ids_at + c]), "logprob": host[base + c]}
                                         for c in range(want)]
            entries[i] = entry
        return token_list, entries
