"""ModelRunner's decode fast path (backend/native_decode.py: the native call's inputs in kept
buffers) against the general path it skips (prepare_arrays, inputs, AttentionMetadata and the
attention plan, then the same native call): the same greedy tokens and the same log probs (the
logits' bits) for staggered requests whose batches grow and shrink, cross block boundaries
(block size 4), run under a sliding window, get preempted and recomputed, and sample with
log probs; the fast path must take the decode steps and leave prompt steps alone.

Oracle: the general path (runner.native_decode None), whose native step is tested bit for bit
against the per-op path in test_native_step.py, itself tested against Hugging Face.
"""
from __future__ import annotations

import random

import pytest

from tritium.backend.engine import LLMEngine
from tritium.backend.native_decode import NativeDecode
from tritium.backend.sampling_params import SamplingParams
from tritium.builder.build import BuildOptions, build_engine

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def engines(tiny_checkpoint, tmp_path_factory):
    """bf16 Mistral with a sliding window of 7 (GQA), and the default int8 build (W8A8, the
    integer-dot head and embedding) of a Llama; block size 4."""
    out = {}
    for name, family, over, kw in (
            ("bf16-window", "mistral", dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                            num_key_value_heads=2, head_dim=32, sliding_window=7),
             dict(dtype="bfloat16", deterministic=True)),
            ("int8", "llama", dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=32), dict(dtype="bfloat16", quantization="int8"))):
        path = str(tmp_path_factory.mktemp(f"fast-{name}") / "engine")
        build_engine(BuildOptions(source=tiny_checkpoint(family, **over), output=path, progress=False,
                                  block_size=4, **kw))
        out[name] = path
    return out


def _workload(seed: int, n: int = 9):
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        prompt = [rng.randrange(3, 200) for _ in range(rng.randint(1, 13))]
        params = SamplingParams(max_tokens=rng.randint(1, 18), temperature=0.0, ignore_eos=True,
                                logprobs=2 if i % 3 == 0 else None)
        reqs.append((prompt, params, rng.randint(0, 10)))
    return reqs


def _run(engine: LLMEngine, reqs):
    """Staggered arrivals; returns each request's (token ids, log prob entries)."""
    final, step, pending = {}, 0, sorted(range(len(reqs)), key=lambda i: reqs[i][2])
    while pending or engine.has_unfinished():
        while pending and reqs[pending[0]][2] <= step:
            i = pending.pop(0)
            engine.add_request(str(i), prompt_token_ids=reqs[i][0], params=reqs[i][1])
        for out in engine.step():
            if out.finished:
                final[int(out.request_id)] = out
        step += 1
    return [(final[i].outputs[0].token_ids, final[i].outputs[0].logprobs) for i in range(len(reqs))]


@pytest.mark.parametrize("name,blocks", [("bf16-window", 64), ("bf16-window", 14), ("int8", 64)])
def test_fast_path_equals_general_path(engines, name, blocks, native_bf16, monkeypatch):
    """14 blocks of 4 tokens for 9 requests of up to 31 tokens: preemptions and recomputes."""
    taken = []
    real = NativeDecode.run

    def counted(self, sched, allowed=True):
        out = real(self, sched, allowed)
        taken.append((len(sched.seqs), out is not None, all(n == 1 for n in sched.num_new_tokens)))
        return out
    monkeypatch.setattr(NativeDecode, "run", counted)
    reqs = _workload(seed=blocks + len(name))
    fast = LLMEngine(engines[name], num_kv_blocks=blocks, enable_prefix_caching=False)
    assert fast.runner.native_decode is not None
    got = _run(fast, reqs)
    general = LLMEngine(engines[name], num_kv_blocks=blocks, enable_prefix_caching=False)
    general.runner.native_decode = None
    want = _run(general, reqs)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g[0] == w[0], (native_bf16, name, i)
        assert g[1] == w[1], (native_bf16, name, i)  # log probs: the same logits, bit for bit
    assert any(ok and rows > 1 for rows, ok, _ in taken), taken  # batched decode steps took it
    assert not any(ok and not decode for _, ok, decode in taken)  # never a step with a prompt chunk
    if blocks == 14:
        assert fast.stats()["preemptions"] > 0
