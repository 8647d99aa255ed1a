"""LLMEngine on tiny random models: batched == alone (greedy), under preemption and small prefill
chunks; prefix caching counted; no leaked block after random add/abort/step; n > 1; stops; bad input.
The oracle for "alone" is the single-sequence loop of tests/simple_generate.py."""
import random

import pytest
import torch

from tritium.backend.engine import LLMEngine
from tritium.backend.errors import RequestError
from tritium.backend.sampling_params import SamplingParams
from simple_generate import generate_simple


# Tiny models: intra-op threads only add barrier waits (see conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


def alone(engine, prompt, max_tokens):
    ids, _ = generate_simple(engine.runner.model, prompt, max_tokens, eos_token_ids=())
    return ids


def run_staggered(engine, reqs, arrivals):
    """reqs: [(prompt_ids, max_tokens)]; request i is added at step arrivals[i]. Returns final outputs."""
    final, step = {}, 0
    pending = sorted(range(len(reqs)), key=lambda i: arrivals[i])
    while pending or engine.has_unfinished():
        while pending and arrivals[pending[0]] <= step:
            i = pending.pop(0)
            engine.add_request(str(i), prompt_token_ids=reqs[i][0],
                               params=SamplingParams(max_tokens=reqs[i][1], temperature=0.0, ignore_eos=True))
        for out in engine.step():
            if out.finished:
                final[int(out.request_id)] = out
        step += 1
    return [final[i] for i in range(len(reqs))]


def workload(seed, n=8, max_prompt=40, max_out=20):
    rng = random.Random(seed)
    reqs = [([rng.randrange(3, 1000) for _ in range(rng.randint(1, max_prompt))], rng.randint(1, max_out))
            for _ in range(n)]
    arrivals = [rng.randint(0, 12) for _ in range(n)]
    return reqs, arrivals


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("mode", ["roomy", "preempt", "chunks"])
def test_batched_equals_alone_greedy(tiny_engine, family, mode):
    kw = {"roomy": dict(num_kv_blocks=64),
          # block_size 4: 8 requests of up to 15 blocks each share 16 blocks
          "preempt": dict(num_kv_blocks=16),
          "chunks": dict(num_kv_blocks=64, max_num_batched_tokens=5)}[mode]
    engine = LLMEngine(tiny_engine(family, block_size=4 if mode == "preempt" else 16), device="cpu", **kw)
    reqs, arrivals = workload(seed=len(family) + len(mode))
    outs = run_staggered(engine, reqs, arrivals)
    for (prompt, max_tokens), out in zip(reqs, outs):
        assert out.outputs[0].token_ids == alone(engine, prompt, max_tokens), (family, mode, len(prompt))
        assert out.outputs[0].finish_reason == "length"
    st = engine.stats()
    if mode == "preempt":
        assert st["preemptions"] > 0
    assert st["kv_blocks_used"] == 0 and st["num_running"] == 0 and st["num_waiting"] == 0


def test_prefix_cache_second_request_computes_only_the_rest(tiny_engine):
    engine = LLMEngine(tiny_engine("llama"), device="cpu", num_kv_blocks=32)
    bs = engine.block_size
    rng = random.Random(3)
    shared = [rng.randrange(3, 1000) for _ in range(3 * bs)]
    a = shared + [5, 6, 7, 8, 9]
    b = shared + [11, 12, 13, 14, 15, 16, 17]
    p = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    (out_a,) = engine.generate(prompt_token_ids=[a], params=p)
    (out_b,) = engine.generate(prompt_token_ids=[b], params=p)
    assert out_a.metrics["num_cached_tokens"] == 0
    assert out_b.metrics["num_cached_tokens"] == 3 * bs
    # b ran only its 7 own prompt tokens plus 5 decode steps (the 6th token needs no forward).
    assert out_b.metrics["num_scheduled_tokens"] == 7 + 5
    assert out_a.metrics["num_scheduled_tokens"] == len(a) + 5
    assert out_b.outputs[0].token_ids == alone(engine, b, 6)
    # Without prefix caching everything is computed, with the same tokens.
    cold = LLMEngine.from_model(engine.config, engine.runner.model, None, num_kv_blocks=32,
                                enable_prefix_caching=False)
    cold.generate(prompt_token_ids=[a], params=p)
    (out_b2,) = cold.generate(prompt_token_ids=[b], params=p)
    assert out_b2.metrics["num_scheduled_tokens"] == len(b) + 5
    assert out_b2.outputs[0].token_ids == out_b.outputs[0].token_ids


def test_random_add_abort_step_leaks_no_block(tiny_engine):
    engine = LLMEngine(tiny_engine("llama"), device="cpu", num_kv_blocks=10, max_num_batched_tokens=24,
                       max_num_seqs=6)
    rng = random.Random(0)
    shared = [rng.randrange(3, 1000) for _ in range(20)]
    live, next_id = [], 0
    for _ in range(1000):
        op = rng.random()
        if op < 0.3:
            prompt = (shared[:rng.randint(0, 20)] + [rng.randrange(3, 1000) for _ in range(rng.randint(1, 20))])
            params = SamplingParams(max_tokens=rng.randint(1, 30), temperature=rng.choice([0.0, 1.0]),
                                    n=rng.choice([1, 1, 2, 3]), seed=rng.choice([None, 5]))
            engine.add_request(str(next_id), prompt_token_ids=prompt, params=params)
            live.append(str(next_id))
            next_id += 1
        elif op < 0.45 and live:
            engine.abort(live.pop(rng.randrange(len(live))))
        else:
            for out in engine.step():
                if out.finished and out.request_id in live:
                    live.remove(out.request_id)
    while engine.has_unfinished():
        engine.step()
    bm = engine.block_manager
    assert all(b.ref_cnt == 0 for b in bm.blocks)
    st = engine.stats()
    assert st["kv_blocks_used"] == 0 and st["kv_blocks_free"] + st["kv_blocks_cached"] == 10
    assert len(bm.free_queue) == 10 and not engine.requests
    assert st["preemptions"] > 0 and st["prefix_cache_hit_tokens"] > 0  # the ops did exercise both


def test_seeded_sampling_reproducible_across_batches(tiny_engine):
    engine = LLMEngine(tiny_engine("llama"), device="cpu", num_kv_blocks=64)
    prompt = [10, 20, 30, 40, 50]
    p = SamplingParams(max_tokens=15, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    (solo,) = engine.generate(prompt_token_ids=[prompt], params=p)
    others = [[7] * 30, [9, 8, 7], list(range(100, 160))]
    mixed = engine.generate(prompt_token_ids=others + [prompt] + others[:1],
                            params=[SamplingParams(max_tokens=9, temperature=0.8, ignore_eos=True)] * 3 + [p]
                            + [SamplingParams(max_tokens=4, temperature=0.0, seed=3)])
    assert mixed[3].outputs[0].token_ids == solo.outputs[0].token_ids
    unseeded = engine.generate(prompt_token_ids=[prompt] * 2, params=SamplingParams(max_tokens=15, ignore_eos=True))
    assert unseeded[0].outputs[0].token_ids != unseeded[1].outputs[0].token_ids


def test_n_samples_share_the_prompt_and_match_single_seeds(tiny_engine):
    engine = LLMEngine(tiny_engine("llama"), device="cpu", num_kv_blocks=64)
    prompt = list(range(40, 61))  # 21 tokens: the fork shares one full and one partial block
    (out,) = engine.generate(prompt_token_ids=[prompt],
                             params=SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=10, ignore_eos=True))
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert out.metrics["num_scheduled_tokens"] == 21 + 3 * 7  # the prompt is computed once
    for c in out.outputs:
        (single,) = engine.generate(prompt_token_ids=[prompt], params=SamplingParams(
            max_tokens=8, temperature=1.0, seed=10 + c.index, ignore_eos=True))
        assert c.token_ids == single.outputs[0].token_ids
    (greedy,) = engine.generate(prompt_token_ids=[prompt], params=SamplingParams(n=2, max_tokens=8, temperature=0))
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids == alone(engine, prompt, 8)[:len(
        greedy.outputs[0].token_ids)]
    assert engine.stats()["kv_blocks_used"] == 0


def test_stop_strings_and_token_ids(tiny_engine):
    engine = LLMEngine(tiny_engine("llama"), device="cpu", num_kv_blocks=64)
    prompt = "The quick brown fox"
    base = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    (full,) = engine.generate([prompt], base)
    text, ids = full.outputs[0].text, full.outputs[0].token_ids
    assert len(text) > 6
    # A 3-character stop string from inside the text (clean characters only).
    start = next(i for i in range(2, len(text) - 3) if "\ufffd" not in text[i:i + 3])
    stop = text[start:start + 3]
    (cut,) = engine.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop]))
    c = cut.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == text[:text.index(stop)]
    (tid,) = engine.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True,
                                                       stop_token_ids=[ids[4]]))
    first = ids.index(ids[4])
    assert tid.outputs[0].token_ids == ids[:first + 1] and tid.outputs[0].finish_reason == "stop"


def test_logprobs_match_model_logits(tiny_engine):
    from simple_generate import prompt_logits
    engine = LLMEngine(tiny_engine("llama"), device="cpu", num_kv_blocks=64)
    prompt = [5, 6, 7, 8]
    (out,) = engine.generate(prompt_token_ids=[prompt],
                             params=SamplingParams(max_tokens=3, temperature=0.0, logprobs=2, ignore_eos=True))
    ids = out.outputs[0].token_ids
    ref = torch.log_softmax(prompt_logits(engine.runner.model, prompt + ids)[len(prompt) - 1:], -1)
    lps = out.outputs[0].logprobs
    for i, e in enumerate(lps):
        assert e["token_id"] == ids[i] and abs(e["logprob"] - ref[i, ids[i]].item()) < 1e-4
        assert [t["token_id"] for t in e["top_logprobs"]] == ref[i].topk(2).indices.tolist()
    assert abs(out.outputs[0].cum_logprob - sum(e["logprob"] for e in lps)) < 1e-6


def test_abort_frees_blocks_and_reports(tiny_engine):
    engine = LLMEngine(tiny_engine("llama"), device="cpu", num_kv_blocks=64)
    engine.add_request("x", prompt_token_ids=list(range(3, 40)), params=SamplingParams(max_tokens=50))
    engine.step()
    engine.step()
    assert engine.stats()["kv_blocks_used"] > 0
    assert engine.abort("x") and not engine.abort("x")
    outs = engine.step()
    assert outs[0].finished and outs[0].outputs[0].finish_reason == "abort"
    assert engine.stats()["kv_blocks_used"] == 0 and not engine.has_unfinished()


BAD = [
    (dict(prompt_token_ids=list(range(3, 300))), dict(), "prompt"),   # > max_seq_len 256
    (dict(prompt_token_ids=[5, 6]), dict(max_tokens=10_000), "max_tokens"),
    (dict(prompt_token_ids=[5, 6]), dict(max_tokens=0), "max_tokens"),
    (dict(prompt_token_ids=[5, 6]), dict(top_p=0.0), "top_p"),
    (dict(prompt_token_ids=[5, 6]), dict(top_p=1.5), "top_p"),
    (dict(prompt_token_ids=[5, 6]), dict(temperature=-0.1), "temperature"),
    (dict(prompt_token_ids=[5, 6]), dict(temperature=float("nan")), "temperature"),
    (dict(prompt=""), dict(), "prompt"),
    (dict(prompt_token_ids=[]), dict(), "prompt"),
    (dict(prompt_token_ids=[5, 100_000]), dict(), "prompt_token_ids"),
    (dict(prompt_token_ids=[5, 6]), dict(n=0), "n"),
    (dict(prompt_token_ids=[5, 6]), dict(logprobs=-1), "logprobs"),
]


def test_bad_input_raises_and_leaves_the_batch_alone(tiny_engine):
    engine = LLMEngine(tiny_engine("llama"), device="cpu", num_kv_blocks=64)
    prompt = list(range(10, 30))
    engine.add_request("good", prompt_token_ids=prompt,
                       params=SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    engine.step()
    before = engine.stats()
    for i, (kw, params, field) in enumerate(BAD):
        with pytest.raises(RequestError, match=field) as e:  # built (range errors) or admitted (context)
            engine.add_request(f"bad{i}", params=SamplingParams(**params), **kw)
        assert e.value.field == ("prompt" if field.startswith("prompt") else field)
    after = engine.stats()
    assert {k: after[k] for k in ("kv_blocks_used", "num_running", "num_waiting")} == \
           {k: before[k] for k in ("kv_blocks_used", "num_running", "num_waiting")}
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("good", prompt_token_ids=[1, 2])
    with pytest.raises(ValueError, match="never fit"):
        LLMEngine.from_model(engine.config, engine.runner.model, None, num_kv_blocks=2).add_request(
            "big", prompt_token_ids=list(range(3, 40)), params=SamplingParams(max_tokens=10))
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            final = out
    assert final.request_id == "good" and final.outputs[0].token_ids == alone(engine, prompt, 12)


@pytest.mark.parametrize("kv_dtype,torch_dtype", [("int8", torch.int8), ("fp8", torch.float8_e4m3fn)])
def test_quantized_kv_cache_batched_equals_alone(tiny_engine, kv_dtype, torch_dtype):
    engine_dir = tiny_engine("llama", kv_cache_dtype=kv_dtype, calibration_samples=4)
    engine = LLMEngine(engine_dir, device="cpu", num_kv_blocks=64)
    assert engine.runner.kv_caches[0][0].dtype == torch_dtype
    reqs, arrivals = workload(seed=11, n=5)
    outs = run_staggered(engine, reqs, arrivals)
    for (prompt, max_tokens), out in zip(reqs, outs):
        (solo,) = LLMEngine(engine_dir, device="cpu", num_kv_blocks=64).generate(
            prompt_token_ids=[prompt], params=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        assert out.outputs[0].token_ids == solo.outputs[0].token_ids


def test_thread_policy_picks_threads_by_step_size(tiny_engine):
    """Small steps (a few decodes) run on small_step_threads, big ones on num_threads; the policy
    changes no token."""
    from tritium.backend.thread_policy import SMALL_STEP_TOKENS, ThreadPolicy
    with pytest.raises(ValueError, match="small_step_threads"):
        ThreadPolicy(2, 0)
    before = torch.get_num_threads()
    seen = []
    try:
        engine = LLMEngine(tiny_engine("llama"), device="cpu", num_kv_blocks=64)
        ref = engine.generate(prompt_token_ids=[[5] * 9], params=SamplingParams(max_tokens=6, temperature=0.0))
        engine.thread_policy = ThreadPolicy(2, 1)
        real_run = engine.runner.run
        engine.runner.run = lambda sched: seen.append((sched.num_batched_tokens, torch.get_num_threads())) \
            or real_run(sched)
        got = engine.generate(prompt_token_ids=[[5] * 9], params=SamplingParams(max_tokens=6, temperature=0.0))
    finally:
        torch.set_num_threads(before)
    assert got[0].outputs[0].token_ids == ref[0].outputs[0].token_ids
    assert seen[0] == (9, 2) and all(n < SMALL_STEP_TOKENS and t == 1 for n, t in seen[1:]) and len(seen) == 6
