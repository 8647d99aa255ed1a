"""Structured outputs in the engine (backend/guided/), on a tiny random Llama with SmolLM2's real
tokenizer. Oracles (tests/structured_cases.py): xgrammar's own matcher replays every output
token, jsonschema validates finished JSON, re.fullmatch checks regex outputs, choices are
compared as strings. Random weights pick adversarial tokens, so the grammar does all the work.
Also: greedy constrained output is the same with preemption and with speculative decoding as
without (exactness), logprobs are the constrained distribution, bad guides fail that request
only with the field named, a grammar dead end finishes with its own reason and leaks nothing."""
import math
import random

import pytest

from structured_cases import Oracle, random_case
from tritium.backend.engine import LLMEngine
from tritium.backend.guided.params import MAX_GUIDE_CHARS, GuidedDecodingParams, from_guide_type, json_schema
from tritium.backend.sampling_params import SamplingParams
from tritium.backend.speculative.config import SpeculativeConfig

pytestmark = pytest.mark.usefixtures("one_thread")
NUM_CASES = 200


@pytest.fixture(scope="module")
def engine_dir(smollm2_tokenizer_engine):
    return smollm2_tokenizer_engine()


@pytest.fixture(scope="module")
def oracle(engine_dir):
    e = LLMEngine(engine_dir)
    return Oracle(e.tokenizer, e.config.model.vocab_size, e.config.model.eos_token_ids)


def cases(seed, n):
    rng = random.Random(seed)
    return [random_case(rng) for _ in range(n)]


def run_staggered(engine, items):
    """items: (prompt, params); request i arrives at step i // 4 (in-flight batching)."""
    final, step, i = {}, 0, 0
    while i < len(items) or engine.has_unfinished():
        while i < len(items) and i // 4 <= step:
            engine.add_request(str(i), prompt=items[i][0], params=items[i][1])
            i += 1
        for out in engine.step():
            if out.finished:
                final[int(out.request_id)] = out
        step += 1
    return [final[k] for k in range(len(items))]


def assert_no_leak(engine):
    bm = engine.block_manager
    assert all(b.ref_cnt == 0 for b in bm.blocks) and len(bm.free_queue) == bm.num_blocks and not engine.requests


def check_all(oracle, cs, outs):
    complete = 0
    for (g, spec), out in zip(cs, outs):
        for comp in out.outputs:
            complete += oracle.check(g, spec, comp)
    return complete


def test_random_guides_in_mixed_batches_obey_their_grammar(engine_dir, oracle):
    """200 random guides (schemas, regexes, choices, free JSON), greedy and sampled, arriving over
    time between unconstrained rows; every output obeys its guide."""
    engine = LLMEngine(engine_dir, max_num_seqs=24)
    cs = cases(0, NUM_CASES)
    rng = random.Random(1)
    items, where = [], []
    for i, (g, _) in enumerate(cs):
        where.append(len(items))
        items.append((f"Request {i}: answer in JSON. " + "x" * rng.randint(0, 30),
                      SamplingParams(max_tokens=96, temperature=rng.choice([0.0, 0.7, 1.0]), seed=i, guided=g)))
        if i % 2:
            items.append((f"free text {i}", SamplingParams(max_tokens=rng.randint(1, 24), temperature=1.0,
                                                           ignore_eos=True)))
    outs = run_staggered(engine, items)
    complete = check_all(oracle, cs, [outs[w] for w in where])
    assert complete >= 0.9 * NUM_CASES  # the rest were cut by max_tokens (still valid prefixes)
    free = [o for k, o in enumerate(outs) if k not in set(where)]
    assert all(o.outputs[0].finish_reason == "length" for o in free)  # unconstrained rows untouched
    assert engine.guide_compiler.num_compiles < NUM_CASES  # repeated guides came from the cache
    assert_no_leak(engine)


def test_preemption_recomputes_with_the_same_grammar_state(engine_dir, oracle):
    cs = cases(2, 24)
    items = [(f"Preempt me {i} " + "y" * (i % 9), SamplingParams(max_tokens=64, temperature=0.0, guided=g))
             for i, (g, _) in enumerate(cs)]
    ref = run_staggered(LLMEngine(engine_dir), items)
    small = LLMEngine(engine_dir, num_kv_blocks=12, enable_prefix_caching=False)
    outs = run_staggered(small, items)
    assert small.scheduler.num_preemptions > 0
    check_all(oracle, cs, outs)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert_no_leak(small)


def test_n4_samples_each_follow_the_grammar(engine_dir, oracle):
    engine = LLMEngine(engine_dir)
    cs = cases(3, 12)
    outs = engine.generate([f"four {i}" for i in range(len(cs))],
                           [SamplingParams(max_tokens=80, temperature=1.0, n=4, seed=i, guided=g)
                            for i, (g, _) in enumerate(cs)])
    assert all(len(o.outputs) == 4 for o in outs)
    check_all(oracle, cs, outs)
    assert any(len({c.text for c in o.outputs}) > 1 for o in outs)  # four independent samples
    assert_no_leak(engine)


def test_device_sampler_under_a_grammar_gives_the_host_tokens(engine_dir, oracle):
    """The bitmask applied before the device sampler (backend/sampler_device.py, static decode
    buffers too): the host sampler's tokens, greedy and seeded, each obeying its guide."""
    from tritium.backend.device_step import DeviceStepOptions
    cs = cases(6, 6)
    params = [SamplingParams(max_tokens=40, temperature=[0.0, 0.8][i % 2], seed=i, guided=g)
              for i, (g, _) in enumerate(cs)]
    prompts = [f"device {i}" for i in range(len(cs))]
    host = LLMEngine(engine_dir).generate(prompts, params)
    dev = LLMEngine(engine_dir, device_step=DeviceStepOptions(device_sampling=True, cuda_graphs=True))
    outs = dev.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in host]
    check_all(oracle, cs, outs)
    assert dev.runner.static_decode.num_steps > 0
    assert_no_leak(dev)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_decoding_under_a_grammar(engine_dir, smollm2_tokenizer_engine, oracle, method):
    """Greedy: token for token what the engine gives without speculation; sampled: obeys the
    grammar. The draft is another random model (its proposals are often off the grammar)."""
    draft = smollm2_tokenizer_engine(seed=1) if method == "draft" else None
    cs = cases(4, 24)
    prompts = [f"spec {i} " + "ab " * (i % 5) for i in range(len(cs))]
    greedy = [SamplingParams(max_tokens=64, temperature=0.0, guided=g) for g, _ in cs]
    ref = LLMEngine(engine_dir).generate(prompts, greedy)
    spec = SpeculativeConfig(method, num_speculative_tokens=4, draft_engine_dir=draft,
                             step_overhead_tokens=float("inf"))
    engine = LLMEngine(engine_dir, speculative=spec)
    outs = engine.generate(prompts, greedy)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert engine.speculator.num_proposed > 0
    sampled = engine.generate(prompts, [SamplingParams(max_tokens=64, temperature=1.0, seed=i, guided=g)
                                        for i, (g, _) in enumerate(cs)])
    check_all(oracle, cs, sampled)
    assert_no_leak(engine)


def test_logprobs_are_the_constrained_distribution(engine_dir, oracle):
    import torch
    import xgrammar as xgr
    engine = LLMEngine(engine_dir)
    g = GuidedDecodingParams("choice", ("yes", "no", "maybe"))
    out = engine.generate(["Pick one"], SamplingParams(max_tokens=8, temperature=0.0, logprobs=20, guided=g))[0]
    first = out.outputs[0].logprobs[0]
    m = xgr.GrammarMatcher(oracle.compiler.compile_grammar(g.grammar()))
    bm = xgr.allocate_token_bitmask(1, engine.config.model.vocab_size)
    m.fill_next_token_bitmask(bm)
    bits = ((bm[0].view(-1, 1) >> torch.arange(32)) & 1).flatten()[:engine.config.model.vocab_size]
    allowed = set(torch.nonzero(bits).flatten().tolist())
    tops = first["top_logprobs"]
    assert 0 < len(tops) == len(allowed) <= 20  # only allowed tokens, all of them (fewer than 20)
    assert {t["token_id"] for t in tops} == allowed
    assert math.isclose(sum(math.exp(t["logprob"]) for t in tops), 1.0, rel_tol=1e-4)
    assert first["token_id"] == tops[0]["token_id"]  # greedy takes the constrained argmax


def test_bad_guides_fail_only_that_request_naming_the_field(engine_dir):
    engine = LLMEngine(engine_dir)
    bad = [
        (lambda: from_guide_type("yaml", "x"), "guided_decoding_guide_type"),
        (lambda: from_guide_type("regex", "a(b"), "does not compile"),
        (lambda: from_guide_type("json_schema", '{"type": "strin"}'), "does not compile"),
        (lambda: from_guide_type("json_schema", "[1, 2]"), "JSON Schema"),
        (lambda: from_guide_type("ebnf_grammar", "root ::= missing"), "does not compile"),
        (lambda: from_guide_type("regex", "a" * (MAX_GUIDE_CHARS + 1)), "at most"),
        (lambda: from_guide_type("choice", "[]"), "non-empty list"),
        (lambda: json_schema({"$ref": "#/nowhere"}, "response_format.json_schema.schema"), "response_format"),
    ]
    for make, words in bad:
        with pytest.raises(ValueError, match=words):
            g = make()
            engine.add_request("bad", prompt="x", params=SamplingParams(guided=g))
    with pytest.raises(ValueError, match="ignore_eos"):
        engine.add_request("bad", prompt="x", params=SamplingParams(ignore_eos=True, guided=GuidedDecodingParams("json")))
    assert not engine.requests and not engine.has_unfinished()
    ok = engine.generate(["fine"], SamplingParams(max_tokens=8, temperature=0.0,
                                                  guided=GuidedDecodingParams("regex", "[ab]{3}")))[0]
    assert len(ok.outputs[0].text) == 3 and set(ok.outputs[0].text) <= {"a", "b"}


def test_dead_end_finishes_with_its_reason_and_frees_blocks(engine_dir):
    """min_tokens bans EOS while the grammar allows only EOS: nothing is allowed."""
    engine = LLMEngine(engine_dir)
    g = GuidedDecodingParams("choice", ("yes",))
    out = engine.generate(["x"], SamplingParams(max_tokens=20, temperature=1.0, min_tokens=10, guided=g))[0]
    c = out.outputs[0]
    assert c.finish_reason == "grammar_dead_end" and c.text == "yes"
    assert_no_leak(engine)


def test_stop_strings_and_prefix_caching_with_a_grammar(engine_dir):
    engine = LLMEngine(engine_dir)
    g = GuidedDecodingParams("choice", ("hello world",))
    out = engine.generate(["say it"], SamplingParams(max_tokens=20, temperature=0.0, stop=["wor"], guided=g))[0]
    assert out.outputs[0].text == "hello " and out.outputs[0].finish_reason == "stop"
    prompt = "a shared prefix that fills several KV blocks " * 4
    p = SamplingParams(max_tokens=40, temperature=0.0, guided=GuidedDecodingParams("regex", "[0-9]{2,5}"))
    first = engine.generate([prompt], p)[0]
    again = engine.generate([prompt], p)[0]
    assert again.metrics["num_cached_tokens"] > 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert engine.guide_compiler.num_hits >= 1
