"""Speculative decoding in LLMEngine on tiny random models: greedy output token-for-token equal to
plain greedy decoding (the single-sequence loop of tests/simple_generate.py is the
oracle) for both proposers and k = 1..8, also under preemption and small prefill chunks; the
features that touch the sampled tokens (n > 1, stop strings, min_tokens, logprobs) give what
the same engine gives without speculation; no KV block of the target or the draft leaks after
requests finish, are aborted or preempted; bad configurations fail with clear errors."""
import random

import pytest
import torch

from tritium.backend.engine import LLMEngine
from tritium.backend.sampling_params import SamplingParams
from simple_generate import generate_simple
from tritium.backend.speculative.config import SpeculativeConfig

pytestmark = pytest.mark.usefixtures("one_thread")
ALWAYS = float("inf")  # step_overhead_tokens: never switch speculation off


def spec(method, k, draft=None, **kw):
    return SpeculativeConfig(method, num_speculative_tokens=k, draft_engine_dir=draft,
                             step_overhead_tokens=kw.pop("step_overhead_tokens", ALWAYS), **kw)


def repetitive_workload(seed, n=8, max_out=48):
    """Prompts that repeat a segment (so the n-gram lookup finds matches), staggered arrivals."""
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        seg = [rng.randrange(3, 1000) for _ in range(rng.randint(1, 6))]
        prompt = (seg * rng.randint(1, 4) + [rng.randrange(3, 1000) for _ in range(rng.randint(0, 6))])[:40]
        reqs.append((prompt, rng.randint(1, max_out)))
    return reqs, [rng.randint(0, 8) for _ in range(n)]


def run_staggered(engine, reqs, arrivals, params=None):
    final, step, pending = {}, 0, sorted(range(len(reqs)), key=lambda i: arrivals[i])
    while pending or engine.has_unfinished():
        while pending and arrivals[pending[0]] <= step:
            i = pending.pop(0)
            p = params or SamplingParams(max_tokens=reqs[i][1], temperature=0.0, ignore_eos=True)
            engine.add_request(str(i), prompt_token_ids=reqs[i][0], params=p)
        for out in engine.step():
            if out.finished:
                final[int(out.request_id)] = out
        step += 1
    return [final[i] for i in range(len(reqs))]


def assert_no_leak(engine):
    bm = engine.block_manager
    assert all(b.ref_cnt == 0 for b in bm.blocks)
    assert len(bm.free_queue) == bm.num_blocks and not engine.requests
    draft = engine.speculator.draft
    if draft is not None:
        draft.release_finished()
        assert not draft.shadows
        assert all(b.ref_cnt == 0 for b in draft.bm.blocks) and len(draft.bm.free_queue) == draft.bm.num_blocks


MODES = {"roomy": dict(num_kv_blocks=64), "preempt": dict(num_kv_blocks=24),
         "chunks": dict(num_kv_blocks=64, max_num_batched_tokens=7)}


@pytest.mark.parametrize("k", range(1, 9))
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_ngram_greedy_equals_plain_greedy(tiny_engine, family, k):
    mode = ["roomy", "preempt", "chunks"][k % 3]
    engine = LLMEngine(tiny_engine(family, block_size=4), device="cpu", speculative=spec("ngram", k), **MODES[mode])
    reqs, arrivals = repetitive_workload(seed=k + len(family))
    outs = run_staggered(engine, reqs, arrivals)
    for (prompt, max_tokens), out in zip(reqs, outs):
        ids, _ = generate_simple(engine.runner.model, prompt, max_tokens, eos_token_ids=())
        assert out.outputs[0].token_ids == ids, (family, k, mode)
    st = engine.stats()
    assert st["spec_proposed_tokens"] > 0  # it did speculate (acceptance: see the next test)
    assert mode != "preempt" or st["preemptions"] > 0
    assert_no_leak(engine)


def test_ngram_accepts_when_the_output_repeats(tiny_engine):
    """The tiny Qwen2 model falls into loops under greedy decoding: the lookup then gets accepted."""
    engine = LLMEngine(tiny_engine("qwen2", block_size=4), device="cpu", num_kv_blocks=64,
                       speculative=spec("ngram", 4))
    reqs, arrivals = repetitive_workload(seed=4)
    outs = run_staggered(engine, reqs, arrivals)
    for (prompt, max_tokens), out in zip(reqs, outs):
        ids, _ = generate_simple(engine.runner.model, prompt, max_tokens, eos_token_ids=())
        assert out.outputs[0].token_ids == ids
    st = engine.stats()
    assert st["spec_accepted_tokens"] > 10


@pytest.mark.parametrize("k", range(1, 9))
def test_draft_greedy_equals_plain_greedy(tiny_engine, k):
    """Draft: the bfloat16 build of the same tiny model (as an int4 build of SmolLM2 drafts for its bf16 one)."""
    mode = ["roomy", "preempt", "chunks"][k % 3]
    engine = LLMEngine(tiny_engine("llama", block_size=4), device="cpu",
                       speculative=spec("draft", k, tiny_engine("llama", dtype="bfloat16", block_size=4)),
                       **MODES[mode])
    reqs, arrivals = repetitive_workload(seed=100 + k)
    outs = run_staggered(engine, reqs, arrivals)
    for (prompt, max_tokens), out in zip(reqs, outs):
        ids, _ = generate_simple(engine.runner.model, prompt, max_tokens, eos_token_ids=())
        assert out.outputs[0].token_ids == ids, (k, mode)
    st = engine.stats()
    # A bf16 copy of the model agrees with it almost always, and never on everything by accident.
    assert st["spec_accepted_tokens"] > 0.5 * st["spec_proposed_tokens"] > 0
    assert_no_leak(engine)


def test_draft_of_another_model_rejects_often_and_stays_exact(tiny_engine, tiny_checkpoint):
    from tritium.builder.build import BuildOptions, build_engine
    import tempfile
    other = tempfile.mkdtemp() + "/engine"
    build_engine(BuildOptions(source=tiny_checkpoint("llama", seed=7), output=other, dtype="float32",
                              progress=False, block_size=4))
    engine = LLMEngine(tiny_engine("llama", block_size=4), device="cpu", num_kv_blocks=64,
                       speculative=spec("draft", 5, other))
    reqs, arrivals = repetitive_workload(seed=3)
    outs = run_staggered(engine, reqs, arrivals)
    for (prompt, max_tokens), out in zip(reqs, outs):
        ids, _ = generate_simple(engine.runner.model, prompt, max_tokens, eos_token_ids=())
        assert out.outputs[0].token_ids == ids
    st = engine.stats()
    assert st["spec_accepted_tokens"] < 0.5 * st["spec_proposed_tokens"]
    assert_no_leak(engine)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_features_match_the_engine_without_speculation(tiny_engine, method):
    """n > 1, stop strings, stop token ids, min_tokens, logprobs: same output as without speculation."""
    path = tiny_engine("llama")
    draft = tiny_engine("llama", dtype="bfloat16") if method == "draft" else None
    plain = LLMEngine(path, device="cpu", num_kv_blocks=64)
    fast = LLMEngine(path, device="cpu", num_kv_blocks=64, speculative=spec(method, 4, draft))
    seg = [11, 12, 13, 14, 15]
    prompts = [seg * 4, [7, 8, 9] * 5 + [1, 2], list(range(40, 70))]
    (ref,) = plain.generate(prompt_token_ids=[prompts[0]],
                            params=SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    text = plain.tokenizer.decode(ref.outputs[0].token_ids)
    stop_str = text[len(text) // 2:len(text) // 2 + 3]  # a stop string that does occur
    stop_tok = ref.outputs[0].token_ids[9]
    cases = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, n=3),
             SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop_str]),
             SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_tok]),
             SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[stop_tok], min_tokens=20),
             SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=3),
             SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, repetition_penalty=1.3,
                            presence_penalty=0.5, frequency_penalty=0.3, bad_words=[text[:4]])]
    for p in cases:
        want = plain.generate(prompt_token_ids=prompts, params=p)
        got = fast.generate(prompt_token_ids=prompts, params=p)
        for w, g in zip(want, got):
            for cw, cg in zip(w.outputs, g.outputs):
                assert cg.token_ids == cw.token_ids, p
                assert (cg.text, cg.finish_reason, cg.stop_reason) == (cw.text, cw.finish_reason, cw.stop_reason), p
                if p.logprobs is not None:
                    for ew, eg in zip(cw.logprobs, cg.logprobs):
                        assert eg["token_id"] == ew["token_id"]
                        assert eg["logprob"] == pytest.approx(ew["logprob"], abs=1e-4)
                        assert [t["token_id"] for t in eg["top_logprobs"]] == [t["token_id"] for t in ew["top_logprobs"]]
    assert fast.stats()["spec_accepted_tokens"] > 0
    assert_no_leak(fast)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_random_add_abort_step_leaks_no_block(tiny_engine, method):
    path = tiny_engine("llama", block_size=4)
    draft = tiny_engine("llama", dtype="bfloat16", block_size=4) if method == "draft" else None
    engine = LLMEngine(path, device="cpu", num_kv_blocks=24, max_num_batched_tokens=24, max_num_seqs=6,
                       speculative=spec(method, 6, draft, draft_num_kv_blocks=30))
    rng = random.Random(1)
    shared = [rng.randrange(3, 1000) for _ in range(12)]
    live, next_id = [], 0
    for _ in range(700):
        op = rng.random()
        if op < 0.25:
            prompt = shared[:rng.randint(0, 12)] + [rng.randrange(3, 1000) for _ in range(rng.randint(1, 8))]
            prompt = prompt * rng.randint(1, 2)
            params = SamplingParams(max_tokens=rng.randint(1, 40), temperature=rng.choice([0.0, 1.0]),
                                    n=rng.choice([1, 1, 2]), seed=rng.choice([None, 5]), top_k=rng.choice([0, 3]))
            engine.add_request(str(next_id), prompt_token_ids=prompt, params=params)
            live.append(str(next_id))
            next_id += 1
        elif op < 0.35 and live:
            engine.abort(live.pop(rng.randrange(len(live))))
        else:
            for out in engine.step():
                if out.finished and out.request_id in live:
                    live.remove(out.request_id)
    while engine.has_unfinished():
        engine.step()
    st = engine.stats()
    assert st["preemptions"] > 0 and st["spec_accepted_tokens"] > 0  # the ops did exercise both
    assert_no_leak(engine)


def test_seeded_sampling_with_speculation_is_reproducible(tiny_engine):
    path = tiny_engine("llama")
    draft = tiny_engine("llama", dtype="bfloat16")
    p = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=77, ignore_eos=True)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    runs = []
    for others in (0, 5):
        engine = LLMEngine(path, device="cpu", num_kv_blocks=64, speculative=spec("draft", 4, draft))
        outs = engine.generate(prompt_token_ids=[prompt] + [[9, 10, 11]] * others,
                               params=[p] + [SamplingParams(max_tokens=12, temperature=1.0)] * others)
        runs.append(outs[0].outputs[0].token_ids)
        assert engine.stats()["spec_proposed_tokens"] > 0
    assert runs[0] == runs[1]


def test_switch_off_rule_turns_speculation_off_for_large_batches(tiny_engine):
    engine = LLMEngine(tiny_engine("llama"), device="cpu", num_kv_blocks=128,
                       speculative=spec("ngram", 4, step_overhead_tokens=4.0))
    sp = engine.speculator
    assert sp.should_speculate(1)        # 1 * (1 - 0.5) < 0.5 * 4
    assert not sp.should_speculate(8)    # 8 * 0.5 >= 2
    prompts = [[5, 6, 7] * 6] * 8
    engine.generate(prompt_token_ids=prompts, params=SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    st = engine.stats()
    assert st["spec_steps_off"] > 0 and st["spec_steps_on"] == 0


def test_bad_configurations_fail_clearly(tiny_engine, tiny_checkpoint):
    with pytest.raises(ValueError, match="speculative method must be one of ngram, draft"):
        SpeculativeConfig("medusa").validate()
    with pytest.raises(ValueError, match=r"num_speculative_tokens must be an integer in \[1, 16\]"):
        SpeculativeConfig("ngram", num_speculative_tokens=0).validate()
    with pytest.raises(ValueError, match="needs draft_engine_dir"):
        LLMEngine(tiny_engine("llama"), device="cpu", speculative=SpeculativeConfig("draft"))
    with pytest.raises(ValueError, match="ngram_min"):
        SpeculativeConfig("ngram", ngram_min=5, ngram_max=2).validate()
    # A draft with another vocabulary size.
    from tritium.builder.build import BuildOptions, build_engine
    import tempfile
    other = tempfile.mkdtemp() + "/engine"
    build_engine(BuildOptions(source=tiny_checkpoint("qwen2", vocab_size=1200), output=other, dtype="float32",
                              progress=False))
    with pytest.raises(ValueError, match="vocabulary of 1200 tokens, the target engine 1000"):
        LLMEngine(tiny_engine("llama"), device="cpu", speculative=spec("draft", 3, other))
