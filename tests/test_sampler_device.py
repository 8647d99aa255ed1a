"""DeviceSampler (backend/sampler_device.py) against the host Sampler (same seeds -> same tokens and
logprobs over many parameter mixes), its top-p threshold against Holtzman et al.'s definition
computed here in numpy, its transfers (ids and logprobs only, no sort), and the counter-based
random stream against the same mixer in exact Python integer arithmetic."""
import math
import random

import numpy as np
import pytest
import torch

from tritium.backend.random_stream import SeedStream, exponential_at, id_hash, mix32, mix32_int
from tritium.backend.sampler import Sampler
from tritium.backend.sampler_device import DeviceSampler, top_p_threshold
from tritium.backend.sampling_params import SamplingParams
from tritium.backend.sequence import Request


def test_tensor_mixer_is_the_integer_mixer():
    rng = random.Random(3)
    vals = [0, 1, 2 ** 31, 2 ** 32 - 1] + [rng.randrange(2 ** 32) for _ in range(2000)]
    got = mix32(torch.tensor(vals, dtype=torch.int64)).tolist()
    assert got == [mix32_int(v) for v in vals]
    assert all(0 <= g < 2 ** 32 for g in got)
    # The noise of one draw: -log(((mix32(key ^ mix32(i)) >> 8) + 1/2) / 2^24), from Python ints.
    key = SeedStream(12345).next_key()
    want = [-math.log(((mix32_int(key ^ mix32_int(i)) >> 8) + 0.5) / 2 ** 24) for i in range(300)]
    got = exponential_at(torch.tensor([key]), id_hash(300, "cpu"))[0].double()
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-6)  # float32 log


def test_seed_stream_is_uniform_and_per_seed():
    s = SeedStream(7)
    u = np.array([s.uniform() for _ in range(20000)])
    counts = np.histogram(u, bins=20, range=(0, 1))[0]
    stat = float(((counts - 1000) ** 2 / 1000).sum())
    assert stat < 50, stat  # chi-square, 19 degrees of freedom: p < 1e-3 above ~43.8
    assert s.counter == 20000
    e = SeedStream(8).exponential(100000)
    assert abs(float(e.mean()) - 1.0) < 0.02 and abs(float(e.var()) - 1.0) < 0.05  # Exp(1)
    a, b = SeedStream(1).exponential(64), SeedStream(1).exponential(64)
    assert torch.equal(a, b) and not torch.equal(a, SeedStream(2).exponential(64))
    big = SeedStream(2 ** 63 - 1)  # the largest seed a request may carry
    assert 0 < big.uniform() < 1


def _seqs(params_list, bad_words=None):
    out = []
    for i, p in enumerate(params_list):
        req = Request(f"r{i}", [1, 2, 3, 5], p, eos_token_ids=(0,), stop_token_ids=(4,),
                      bad_words_ids=bad_words or ())
        s = req.seqs[0]
        s.token_ids.extend([7, 7, 9])
        out.append(s)
    return out


def _random_params(rng, all_top_k):
    return SamplingParams(
        temperature=rng.choice([0.0, 0.4, 1.0, 1.6]),
        top_k=rng.choice([1, 4, 40]) if all_top_k else rng.choice([None, 4, 40]),
        top_p=rng.choice([1.0, 0.95, 0.6]), min_p=rng.choice([0.0, 0.05, 0.3]),
        seed=rng.choice([None, rng.randrange(2 ** 63)]),
        repetition_penalty=rng.choice([1.0, 1.3, 0.8]), presence_penalty=rng.choice([0.0, 0.5]),
        frequency_penalty=rng.choice([0.0, -0.3]), logprobs=rng.choice([None, 0, 3]),
        min_tokens=rng.choice([0, 5]), logit_bias=rng.choice([None, {5: 4.0, 11: -100.0}]))


@pytest.mark.parametrize("all_top_k", [True, False], ids=["topk-candidates", "threshold-search"])
def test_device_sampler_equals_host_sampler(all_top_k):
    """Same seeds, same tokens and logprobs, step after step (seeded streams advance)."""
    rng = random.Random(11 if all_top_k else 12)
    vocab, rows, steps = 257, 12, 3
    mismatches = total = sampled = 0
    for trial in range(60):
        params = [_random_params(rng, all_top_k) for _ in range(rows)]
        bad = [[9, 6], [13]] if trial % 3 == 0 else None
        host, dev = _seqs(params, bad), _seqs(params, bad)
        for step in range(steps):
            logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(trial * 7 + step)) * 3
            torch.manual_seed(trial * 100 + step)  # unseeded rows: torch's default generator, same draws
            t1, e1 = Sampler()(logits.clone(), host)
            torch.manual_seed(trial * 100 + step)
            t2, e2 = DeviceSampler()(logits.clone(), dev)
            total += rows
            sampled += sum(not p.is_greedy for p in params)
            mismatches += sum(a != b for a, b in zip(t1, t2))
            assert e1 == e2
            for s, t in zip(host, t1):
                s.token_ids.append(t)
            for s, t in zip(dev, t2):
                s.token_ids.append(t)
        assert [s.generator.counter for s in host if s.generator] == [s.generator.counter for s in dev if s.generator]
    assert mismatches == 0, f"{mismatches} of {total} tokens differ"
    assert sampled > total // 2


def _nucleus(p, top_p):
    """Holtzman et al. (2020): the smallest set of most likely tokens whose mass reaches top_p."""
    order = np.argsort(-p, kind="stable")
    keep, mass = [], 0.0
    for i in order:
        keep.append(i)
        mass += p[i]
        if mass >= top_p:
            break
    return set(int(i) for i in keep)


def test_top_p_threshold_is_the_nucleus():
    g = torch.Generator().manual_seed(4)
    for scale in (0.5, 2.0, 6.0):
        logits = torch.randn(40, 1000, generator=g, dtype=torch.float64) * scale
        probs64 = logits.softmax(-1)
        top_p = torch.rand(40, generator=g, dtype=torch.float64) * 0.98 + 0.01
        t = top_p_threshold(probs64.float(), top_p.float())
        for r in range(40):
            kept = set(torch.nonzero(probs64[r].float() >= t[r]).flatten().tolist())
            assert kept == _nucleus(probs64[r].numpy(), float(top_p[r].float())), (scale, r)


def test_only_ids_and_logprobs_come_back_and_nothing_is_sorted(monkeypatch):
    moved = []
    real_cpu = torch.Tensor.cpu

    def counting_cpu(self, *a, **k):
        moved.append(self.numel())
        return real_cpu(self, *a, **k)

    def no_sort(*a, **k):
        raise AssertionError("full sort in the device sampler")
    monkeypatch.setattr(torch.Tensor, "cpu", counting_cpu)
    monkeypatch.setattr(torch.Tensor, "sort", no_sort)
    monkeypatch.setattr(torch, "sort", no_sort)
    monkeypatch.setattr(torch.Tensor, "argsort", no_sort)
    vocab = 5000
    params = [SamplingParams(temperature=1.0, top_p=0.8, logprobs=2, seed=1),
              SamplingParams(temperature=0.7, top_k=50, min_p=0.1),
              SamplingParams(temperature=0.0, logprobs=0),
              SamplingParams(temperature=1.0, top_p=0.5, repetition_penalty=1.2)]
    toks, entries = DeviceSampler()(torch.randn(4, vocab), _seqs(params))
    assert len(toks) == 4 and all(0 <= t < vocab for t in toks)
    assert [e is not None for e in entries] == [True, False, True, False]
    assert len(entries[0]["top_logprobs"]) == 2 and entries[2]["top_logprobs"] == []
    # 4 ids + 2 chosen logprobs + 2 x 2 (top value, top id): one copy, never a vocabulary row.
    assert moved == [4 + 2 + 2 * 2 * 2]
