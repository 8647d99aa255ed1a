"""Sampler against the definitions: empirical frequencies vs. the truncated distributions computed
independently here in numpy; penalties vs. their formulas; seeds vs. batch composition. Every test
runs the host Sampler and the batched DeviceSampler (here on CPU) against the same oracle."""
import numpy as np
import pytest
import torch

from tritium.backend.sampler import Sampler, apply_penalties
from tritium.backend.sampler_device import DeviceSampler, apply_penalties_device
from tritium.backend.sampling_params import SamplingParams
from tritium.backend.sequence import Request

LOGITS = np.array([2.0, 1.5, 1.2, 0.7, 0.3, 0.0, -0.5, -1.0], dtype=np.float64)
N_SAMPLES = 24000


@pytest.fixture(params=[Sampler, DeviceSampler], ids=["host", "device"])
def sampler(request):
    return request.param


def seqs_for(params, count=1, prompt=(1, 2, 3), output=(), **req_kw):
    out = []
    for i in range(count):
        req = Request(f"r{i}", list(prompt), params, **req_kw)
        s = req.seqs[0]
        s.token_ids.extend(output)
        out.append(s)
    return out


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def empirical(sampler, params, logits=LOGITS):
    torch.manual_seed(1234)
    seqs = seqs_for(params) * N_SAMPLES  # unseeded: every row draws independent noise
    toks, _ = sampler()(torch.tensor(logits, dtype=torch.float32).repeat(N_SAMPLES, 1), seqs)
    return np.bincount(toks, minlength=len(logits)) / N_SAMPLES


def expected_top_k(logits, k, temp):
    p = softmax(logits / temp)
    keep = np.argsort(-p)[:k]
    q = np.zeros_like(p)
    q[keep] = p[keep]
    return q / q.sum()


def expected_top_p(logits, top_p, temp):
    # Holtzman et al.: the smallest set of most likely tokens whose total mass is >= top_p.
    p = softmax(logits / temp)
    order = np.argsort(-p)
    total, keep = 0.0, []
    for i in order:
        keep.append(i)
        total += p[i]
        if total >= top_p:
            break
    q = np.zeros_like(p)
    q[keep] = p[keep]
    return q / q.sum()


def expected_min_p(logits, min_p, temp):
    # Nguyen et al.: keep tokens with p >= min_p * max(p).
    p = softmax(logits / temp)
    q = np.where(p >= min_p * p.max(), p, 0.0)
    return q / q.sum()


def check(freq, expected):
    assert np.all(freq[expected == 0] == 0), f"sampled outside the support: {freq} vs {expected}"
    # 24000 draws: std <= 0.0033 per token; 0.017 is > 5 sigma.
    np.testing.assert_allclose(freq, expected, atol=0.017)


@pytest.mark.parametrize("temp", [1.0, 0.6])
def test_temperature_matches_softmax(sampler, temp):
    check(empirical(sampler, SamplingParams(temperature=temp)), softmax(LOGITS / temp))


@pytest.mark.parametrize("k", [1, 3, 5])
def test_top_k(sampler, k):
    check(empirical(sampler, SamplingParams(temperature=0.8, top_k=k)), expected_top_k(LOGITS, k, 0.8))


@pytest.mark.parametrize("top_p", [0.3, 0.6, 0.9])
def test_top_p(sampler, top_p):
    check(empirical(sampler, SamplingParams(temperature=1.0, top_p=top_p)), expected_top_p(LOGITS, top_p, 1.0))


@pytest.mark.parametrize("min_p", [0.1, 0.3, 0.6])
def test_min_p(sampler, min_p):
    check(empirical(sampler, SamplingParams(temperature=1.3, min_p=min_p)), expected_min_p(LOGITS, min_p, 1.3))


def test_mixed_rows_each_follow_their_own_params(sampler):
    torch.manual_seed(5)
    per = 8000
    a = seqs_for(SamplingParams(temperature=1.0, top_k=2)) * per
    b = seqs_for(SamplingParams(temperature=0.0)) * per
    c = seqs_for(SamplingParams(temperature=1.0, top_p=0.5)) * per
    mixed = [s for trio in zip(a, b, c) for s in trio]
    toks, _ = sampler()(torch.tensor(LOGITS, dtype=torch.float32).repeat(len(mixed), 1), mixed)
    toks = np.array(toks)
    np.testing.assert_allclose(np.bincount(toks[0::3], minlength=8) / per, expected_top_k(LOGITS, 2, 1.0), atol=0.03)
    assert np.all(toks[1::3] == 0)
    np.testing.assert_allclose(np.bincount(toks[2::3], minlength=8) / per, expected_top_p(LOGITS, 0.5, 1.0), atol=0.03)


@pytest.mark.parametrize("apply", [apply_penalties, apply_penalties_device], ids=["host", "device"])
def test_penalties_follow_their_formulas(apply):
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    p = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    (s,) = seqs_for(p, prompt=(1,), output=(3, 3, 5))
    x = logits.clone()
    apply(x, [s])
    # CTRL: seen tokens (prompt 1, output 3, 5) -> l/r if l > 0 else l*r; then OpenAI presence/frequency
    # over output counts (3: twice, 5: once).
    want = [2.0, -1.0 * 2, 0.5, 3.0 / 2 - 0.5 - 0.25 * 2, -2.0, 1.0 / 2 - 0.5 - 0.25]
    torch.testing.assert_close(x[0], torch.tensor(want))


def test_seeded_sampling_independent_of_batch(sampler):
    logits = torch.randn(1, 50)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=42)
    alone = []
    (s,) = seqs_for(params)
    for _ in range(20):
        tok, _ = sampler()(logits, [s])
        alone.append(tok[0])
    (s2,) = seqs_for(params)
    others = seqs_for(SamplingParams(temperature=1.0, seed=7), count=3) + seqs_for(SamplingParams(temperature=0.5), 2)
    batched = []
    for step in range(20):
        batch = others[: step % 5] + [s2] + others[step % 5:]
        toks, _ = sampler()(torch.cat([torch.randn(step % 5, 50), logits, torch.randn(5 - step % 5, 50)]), batch)
        batched.append(toks[step % 5])
    assert alone == batched
    assert len(set(alone)) > 1  # it really sampled


def test_bad_words_and_min_tokens_bans(sampler):
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0, 1.0]])
    # eos 1 banned until min_tokens; stop id 2 too; bad word [4, 3]: 3 banned right after a 4.
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[2])
    (s,) = seqs_for(p, output=(4,), eos_token_ids=(1,), stop_token_ids=(2,), bad_words_ids=[[4, 3]])
    toks, _ = sampler()(logits, [s])
    assert toks == [4]
    s.token_ids.append(0)  # 2 outputs now: eos and stop allowed again, last token 0 lifts the bad word
    toks, _ = sampler()(logits, [s])
    assert toks == [1]


def test_logprobs_are_raw_log_softmax(sampler):
    logits = torch.randn(2, 30)
    p = SamplingParams(temperature=0.0, repetition_penalty=1.5, logprobs=3)
    seqs = seqs_for(p, count=2, prompt=(5, 6))
    toks, entries = sampler()(logits, seqs)
    ref = torch.log_softmax(logits.double(), -1)
    for i, e in enumerate(entries):
        assert e["token_id"] == toks[i]
        assert abs(e["logprob"] - ref[i, toks[i]].item()) < 1e-5
        top = sorted(range(30), key=lambda t: -ref[i, t].item())[:3]
        assert [t["token_id"] for t in e["top_logprobs"]] == top


def test_argmax_rows_is_the_first_maximal_index():
    # the oracle: torch.max(dim)'s index (first maximal, NaN counts as the maximum) on the same rows
    from tritium.backend.sampler import argmax_rows
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 4099, generator=g)
    x[1, 3] = x[1, 4000] = float("nan")  # first NaN wins
    x[2] = float("-inf")  # a fully banned row: index 0
    x[3, 10] = x[3, 20] = 1e9  # ties: the first
    x[4, 4098] = float("inf")
    x[5] = 0.0  # all equal
    assert argmax_rows(x).tolist() == [int(np.nanargmax(x[0].numpy())), 3, 0, 10, 4098, 0]
    assert argmax_rows(x).tolist() == x.max(dim=-1).indices.tolist()
    y = x[:, 1::3]  # a strided view
    assert argmax_rows(y).tolist() == y.max(dim=-1).indices.tolist()
    assert argmax_rows(y).dtype == torch.int64


def test_plain_greedy_rows_match_the_full_pipeline(sampler):
    # Greedy rows with nothing else asked skip steps 1-6; the same rows asking logprobs (or
    # penalties that are no-ops here) take the whole pipeline: same tokens.
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 300, generator=g)
    logits[2, 7] = logits[2, 9] = 50.0  # a tie: the first index
    plain = seqs_for(SamplingParams(temperature=0.0), count=5)
    full = seqs_for(SamplingParams(temperature=0.0, logprobs=0), count=5)
    t1, e1 = sampler()(logits.clone(), plain)
    t2, e2 = sampler()(logits.clone(), full)
    assert t1 == t2 == logits.numpy().argmax(axis=1).tolist()
    assert t1[2] == 7 and e1 == [None] * 5 and all(e is not None for e in e2)
