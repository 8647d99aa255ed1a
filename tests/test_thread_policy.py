"""ThreadPolicy / ThreadTuner (backend/thread_policy.py): the server's choice of threads per step.

The tuner is fed step times from a model of the host written here (seconds per token of each
thread count, changing over time), so the tests know which count is faster at each moment and
check that the tuner follows it, and what exploring the slower one costs. Through the engine, a
tuned policy that switches thread counts between steps changes no token."""
from __future__ import annotations

import pytest
import torch

from tritium.backend.engine import LLMEngine
from tritium.backend.sampling_params import SamplingParams
from tritium.backend.thread_policy import MID_STEP_TOKENS, SMALL_STEP_TOKENS, ThreadPolicy, ThreadTuner


def _drive(tuner: ThreadTuner, cost, steps: int, start: int = 0):
    """Run `steps` steps; cost(step, count) -> seconds per token. Returns the counts chosen."""
    chosen = []
    for i in range(start, start + steps):
        n = tuner.choose()
        chosen.append(n)
        tuner.observe(n, cost(i, n))
    return chosen


def test_tuner_moves_to_the_faster_count():
    tuner = ThreadTuner((1, 2))
    chosen = _drive(tuner, lambda i, n: 0.010 if n == 1 else 0.006, 200)
    assert tuner.best == 2
    # it starts on 1, explores 2 after MIN_INTERVAL steps and keeps it from then on (explorations of 1 aside)
    first_two = chosen.index(2)
    assert first_two == ThreadTuner.MIN_INTERVAL
    assert chosen[first_two:].count(1) <= 3 * (len(chosen) // ThreadTuner.MIN_INTERVAL)


def test_exploring_a_much_slower_count_costs_little():
    tuner = ThreadTuner((1, 2))
    chosen = _drive(tuner, lambda i, n: 0.005 if n == 1 else 0.050, 20000)  # 2 threads 10x slower
    assert tuner.best == 1 and tuner.interval == ThreadTuner.MAX_INTERVAL
    slow = chosen.count(2)
    extra = slow * (0.050 - 0.005) / (len(chosen) * 0.005)
    assert extra < 0.05, (slow, extra)  # under 5 % more time than always choosing 1


def test_tuner_follows_a_host_that_changes():
    """Two threads win while the host is idle, lose while other jobs take the cores, win again."""
    def cost(i, n):
        busy = 3000 <= i < 6000
        return (0.006 if n == 2 else 0.010) if not busy else (0.080 if n == 2 else 0.012)
    tuner = ThreadTuner((1, 2))
    _drive(tuner, cost, 3000)
    assert tuner.best == 2
    chosen = _drive(tuner, cost, 3000, start=3000)
    assert tuner.best == 1
    assert chosen[-2000:].count(2) < 20  # settled on one thread while busy
    _drive(tuner, cost, 3000, start=6000)
    assert tuner.best == 2


def test_noise_does_not_flip_the_choice_often():
    """Step times with +-20 % jitter (seeded) and 1.5x between the counts: the faster count runs
    at least 85 % of the steps."""
    g = torch.Generator().manual_seed(0)
    jitter = (torch.rand(10000, generator=g) * 0.4 + 0.8).tolist()
    tuner = ThreadTuner((1, 2))
    chosen = _drive(tuner, lambda i, n: jitter[i] * (0.009 if n == 1 else 0.006), 10000)
    assert chosen.count(2) > 0.85 * len(chosen)


def test_policy_classes_and_fixed_counts():
    tuned = ThreadPolicy(2)
    assert set(tuned.tuners) == {"small", "mid4", "mid8", "mid16"}
    assert [tuned.step_class(n) for n in (1, 3, 4, 7, 8, 15, 16, 32, 33)] == \
        ["small", "small", "mid4", "mid4", "mid8", "mid8", "mid16", "mid16", "big"]
    assert tuned.threads_for(MID_STEP_TOKENS + 1) == 2 and tuned.threads_for(4096) == 2  # big steps: every thread
    assert tuned.threads_for(1) == 2 and tuned.threads_for(SMALL_STEP_TOKENS) == 2  # every class starts on all threads
    fixed = ThreadPolicy(2, 1)
    assert not fixed.tuners
    assert [fixed.threads_for(n) for n in (1, SMALL_STEP_TOKENS - 1, SMALL_STEP_TOKENS, 64)] == [1, 1, 2, 2]
    assert not ThreadPolicy(1).tuners  # one core: nothing to choose
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="small_step_threads"):
            ThreadPolicy(2, bad)
    with pytest.raises(ValueError, match="num_threads"):
        ThreadPolicy(0)


def test_server_default_is_tuned_and_explicit_value_is_kept():
    from tritium.backend.engine_options import engine_setup
    server = engine_setup({"num_threads": 2}, None, server=True)
    assert server.thread_policy.tuners and server.thread_policy.small_step_threads is None
    fixed = engine_setup({"num_threads": 2, "small_step_threads": 1}, None, server=True)
    assert not fixed.thread_policy.tuners and fixed.thread_policy.small_step_threads == 1


def test_tuned_policy_switching_threads_changes_no_token(tiny_engine, monkeypatch):
    """The tuner explores every few steps here, so decode steps alternate between 1 and 2
    threads; greedy tokens equal those of an engine without a policy."""
    monkeypatch.setattr(ThreadTuner, "MIN_INTERVAL", 2)
    monkeypatch.setattr(ThreadTuner, "MAX_INTERVAL", 2)
    before = torch.get_num_threads()
    seen = []
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    try:
        torch.set_num_threads(1)
        engine = LLMEngine(tiny_engine("llama"), device="cpu", num_kv_blocks=64)
        ref = engine.generate(prompt_token_ids=[[5, 9, 31, 7] * 3, [11, 3]], params=params)
        engine.thread_policy = ThreadPolicy(2)
        real_run = engine.runner.run
        engine.runner.run = lambda sched: seen.append((sched.num_batched_tokens, torch.get_num_threads())) \
            or real_run(sched)
        got = engine.generate(prompt_token_ids=[[5, 9, 31, 7] * 3, [11, 3]], params=params)
    finally:
        torch.set_num_threads(before)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    small = {t for n, t in seen if n < SMALL_STEP_TOKENS}
    assert small == {1, 2}, seen
    assert engine.thread_policy.tuners["small"].cost[1] is not None
    assert engine.thread_policy.tuners["small"].cost[2] is not None
