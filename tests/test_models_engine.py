"""The engine features on the new families (tiny random checkpoints of tests/tiny_models.py):
16 mixed rows batched == each alone (tests/simple_generate.py, itself checked against
transformers in test_models_families.py), with small prefill chunks, under preemption, with a
quantized KV cache, prefix caching across the sliding window, n-gram speculative decoding, and
tensor parallelism (TP = 2 == TP = 1 == transformers)."""
from __future__ import annotations

import random

import pytest
import torch

from tritium.backend.engine import LLMEngine
from tritium.backend.sampling_params import SamplingParams
from tritium.backend.speculative.config import SpeculativeConfig
from simple_generate import generate_simple
from test_runtime_engine import run_staggered  # noqa: F401 (also imported from here by test_models_moe)
from tp_utils import record_logits, tp_timeout, wait_no_workers  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


def alone(engine, prompt, max_tokens):
    return generate_simple(engine.runner.model, prompt, max_tokens, eos_token_ids=())[0]


def workload(seed, n=16, max_prompt=30, max_out=12):
    """16 rows of mixed prompt lengths (1 to 30: most longer than the sliding windows) and outputs."""
    rng = random.Random(seed)
    reqs = [([rng.randrange(3, 1000) for _ in range(rng.randint(1, max_prompt))], rng.randint(1, max_out))
            for _ in range(n)]
    return reqs, [rng.randint(0, 6) for _ in range(n)]


MODES = {"roomy": dict(num_kv_blocks=128),
         "chunks": dict(num_kv_blocks=128, max_num_batched_tokens=5),
         # block_size 4: 16 rows of up to 11 blocks each share 24 blocks
         "preempt": dict(num_kv_blocks=24)}


@pytest.mark.parametrize("family", ["qwen3", "gemma3", "gemma2", "olmo2"])
@pytest.mark.parametrize("mode", list(MODES))
def test_batched_16_rows_equal_alone(tiny_engine, family, mode):
    engine = LLMEngine(tiny_engine(family, block_size=4), device="cpu", **MODES[mode])
    reqs, arrivals = workload(seed=len(family) * 7 + len(mode))
    outs = run_staggered(engine, reqs, arrivals)
    for (prompt, max_tokens), out in zip(reqs, outs):
        assert out.outputs[0].token_ids == alone(engine, prompt, max_tokens), (family, mode, len(prompt))
    st = engine.stats()
    assert mode != "preempt" or st["preemptions"] > 0
    assert st["kv_blocks_used"] == 0 and st["num_running"] == 0


@pytest.mark.parametrize("family,kv", [("gemma2", "int8"), ("gemma3", "fp8"), ("qwen3", "int8")])
def test_quantized_kv_cache_batched_equals_alone(tiny_engine, family, kv):
    """The alone reference is a fresh engine with the same quantized cache (simple_generate's cache
    is a float one)."""
    path = tiny_engine(family, kv_cache_dtype=kv, block_size=4, calibration_samples=4)
    engine = LLMEngine(path, device="cpu", num_kv_blocks=128)
    assert engine.runner.kv_caches[0][0].dtype == {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[kv]
    reqs, arrivals = workload(seed=5, n=6)
    outs = run_staggered(engine, reqs, arrivals)
    solo_engine = LLMEngine(path, device="cpu", num_kv_blocks=128)
    for (prompt, max_tokens), out in zip(reqs, outs):
        (solo,) = solo_engine.generate(prompt_token_ids=[prompt], params=SamplingParams(
            max_tokens=max_tokens, temperature=0, ignore_eos=True))
        assert out.outputs[0].token_ids == solo.outputs[0].token_ids, (family, kv)


def test_prefix_cache_across_the_sliding_window(tiny_engine):
    """Gemma 3 (window 6): a second prompt sharing 3 blocks reuses them and gets its own tokens."""
    engine = LLMEngine(tiny_engine("gemma3", block_size=4), device="cpu", num_kv_blocks=64)
    rng = random.Random(11)
    shared = [rng.randrange(3, 1000) for _ in range(12)]
    a, b = shared + [5, 6, 7], shared + [9, 10, 11, 12, 13]
    p = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.generate(prompt_token_ids=[a], params=p)
    (out_b,) = engine.generate(prompt_token_ids=[b], params=p)
    assert out_b.metrics["num_cached_tokens"] == 12
    assert out_b.outputs[0].token_ids == alone(engine, b, 8)


@pytest.mark.parametrize("family", ["qwen3", "gemma3", "smollm3"])
def test_ngram_speculation_equals_plain_greedy(tiny_engine, family):
    spec = SpeculativeConfig("ngram", num_speculative_tokens=3, step_overhead_tokens=float("inf"))
    engine = LLMEngine(tiny_engine(family, block_size=4), device="cpu", num_kv_blocks=128, speculative=spec)
    rng = random.Random(2)
    reqs = []
    for _ in range(6):
        seg = [rng.randrange(3, 1000) for _ in range(rng.randint(2, 5))]
        reqs.append(((seg * 4)[:20], rng.randint(4, 16)))
    outs = run_staggered(engine, reqs, [0, 0, 1, 2, 3, 4])
    for (prompt, max_tokens), out in zip(reqs, outs):
        assert out.outputs[0].token_ids == alone(engine, prompt, max_tokens), family
    assert engine.stats()["spec_proposed_tokens"] > 0


PROMPTS = [[5, 17, 923, 44, 300, 2, 81, 999, 13, 640, 7, 7, 7, 250], [1, 600, 601, 602], [999]]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def greedy_with_logits(engine):
    logs = record_logits(engine)
    outs = engine.generate(prompt_token_ids=PROMPTS, params=GREEDY)
    return [o.outputs[0].token_ids for o in outs], logs


@pytest.mark.usefixtures("tp_timeout")
@pytest.mark.parametrize("family", ["qwen3", "gemma3", "olmo2"])
def test_tp2_equals_tp1_and_hf(family, tiny_checkpoint, tiny_engine):
    """Gemma 3 has one KV head (replicated on both ranks); OLMo 2's q/k norms span the heads of
    both ranks (their sums of squares are all-reduced)."""
    from transformers import AutoModelForCausalLM
    with LLMEngine(tiny_engine(family, "float32"), device="cpu", num_kv_blocks=64) as e1:
        tok1, log1 = greedy_with_logits(e1)
    path = tiny_engine(family, "float32", tensor_parallel_size=2)
    with LLMEngine(path, device="cpu", num_kv_blocks=64, threads_per_rank=1) as e2:
        tok2, log2 = greedy_with_logits(e2)
    assert tok2 == tok1
    for a, b in zip(log2, log1):
        assert a.shape == b.shape and rel_err(a, b) < 1e-4
    hf = AutoModelForCausalLM.from_pretrained(tiny_checkpoint(family), dtype=torch.float32).eval()
    for s, (prompt, gen) in enumerate(zip(PROMPTS, tok2)):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt + gen])).logits[0]
        ours = torch.stack([log2[step][s] for step in range(len(gen))])
        assert rel_err(ours, ref[len(prompt) - 1:len(prompt) - 1 + len(gen)]) < 1e-4, family
    assert not wait_no_workers(path), "a worker outlived close()"
