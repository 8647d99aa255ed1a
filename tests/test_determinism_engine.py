"""Same prompt, same answer (docs/determinism.md): a bfloat16 engine's greedy tokens for a prompt do
not depend on what else runs in the step. The oracle is the engine itself asked alone on a cold
cache; every other way of running the same prompt must give exactly its tokens:
in a batch of 16, with 5-token prefill chunks, from the prefix cache, preempted and recomputed,
and with n-gram and draft speculation (k + 1 rows verified together).

Before batch-invariant kernels these differed within tens of tokens (bf16 SmolLM2: 7 of 8 repeats
of four held-out prompts; the README's own question answered "L'Étoile, ..." from the prefix cache).
"""
import pytest

from tritium.backend.engine import LLMEngine
from tritium.backend.sampling_params import SamplingParams
from tritium.backend.speculative.config import SpeculativeConfig

pytestmark = pytest.mark.usefixtures("one_thread", "native_bf16_x86")


QUESTIONS = ["What is the capital of France?",
             "Explain why the sky is blue in two sentences.",
             "Write a short poem about a lighthouse keeper.",
             "What are three good habits for learning a new language?"]
PARAMS = SamplingParams(max_tokens=64, temperature=0.0)
PROMPTS, OTHERS = [], []  # filled by the engine_dir fixture, through the engine's chat template


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def engine_dir(smollm2_engine):
    from tritium.backend.chat_template import ChatTemplate
    d = smollm2_engine("bfloat16")
    tpl = ChatTemplate.from_engine_dir(d)  # as the OpenAI route renders a chat (system prompt included)
    PROMPTS[:] = [tpl.render([{"role": "user", "content": q}]) for q in QUESTIONS]
    OTHERS[:] = [tpl.render([{"role": "user", "content": f"Tell me a fact about the number {i}."}])
                 for i in range(12)]
    return d


@pytest.fixture(scope="module")
def alone(engine_dir, native_bf16_x86):
    """Each prompt alone, on a cold cache with prefix caching off, on the path under test: the
    reference."""
    eng = LLMEngine(engine_dir, device="cpu", num_kv_blocks=64, enable_prefix_caching=False)
    return [tokens(eng.generate([p], PARAMS))[0] for p in PROMPTS]


def test_the_readme_question_answers_paris_again_from_the_prefix_cache(engine_dir, alone):
    """Issue 34's sequence in-process: the README's question, 48 tokens, then again with its prompt
    from the prefix cache (before: "The capital of France is Paris.", then "L'Étoile, la
    Marseillaise, ..." on every later call)."""
    eng = LLMEngine(engine_dir, device="cpu", num_kv_blocks=64)
    params = SamplingParams(max_tokens=48, temperature=0.0)
    first, again = (eng.generate([PROMPTS[0]], params)[0].outputs[0].text for _ in range(2))
    assert eng.stats()["prefix_cache_hit_tokens"] > 0
    assert "Paris" in first and again == first, (first, again)
    assert eng.tokenizer.decode(alone[0]).startswith(first)


def test_batch_of_16_and_prefix_cache(engine_dir, alone):
    eng = LLMEngine(engine_dir, device="cpu", num_kv_blocks=256)
    batch = tokens(eng.generate(PROMPTS + OTHERS, PARAMS))[:len(PROMPTS)]
    assert batch == alone
    # asked again: the prompts now come from the prefix cache (a different query length per step)
    st0 = eng.stats()
    again = tokens(eng.generate(PROMPTS, PARAMS))
    assert eng.stats()["prefix_cache_hit_tokens"] > st0.get("prefix_cache_hit_tokens", 0)
    assert again == alone


def test_prefill_chunks_of_5(engine_dir, alone):
    eng = LLMEngine(engine_dir, device="cpu", num_kv_blocks=64, max_num_batched_tokens=5,
                    enable_prefix_caching=False)
    assert tokens(eng.generate(PROMPTS, PARAMS)) == alone


def _on_the_hosts_own_path_only(path: str) -> None:
    """Preemption and speculation reschedule the kernels that the batch, chunk and prefix tests
    already check on every forced path; they run on the path the host picks itself (the suite's
    time: each SmolLM2 run takes minutes on a busy 2-core host)."""
    from tritium.kernels import cpu_isa
    best = cpu_isa.runnable()[0]
    if path != best:
        pytest.skip(f"{path} is forced below this host's own path ({best}); preemption / speculation run on "
                    f"{best} (the batch, chunk and prefix tests cover {path})")


def test_preempted_and_recomputed(engine_dir, alone, native_bf16_x86):
    _on_the_hosts_own_path_only(native_bf16_x86)
    # 16 requests of up to 7 blocks (block_size 16) each share 32 blocks: some are preempted
    eng = LLMEngine(engine_dir, device="cpu", num_kv_blocks=32, enable_prefix_caching=False)
    out = tokens(eng.generate(PROMPTS + OTHERS, PARAMS))[:len(PROMPTS)]
    assert eng.stats()["preemptions"] > 0
    assert out == alone


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculation(engine_dir, alone, method, native_bf16_x86):
    _on_the_hosts_own_path_only(native_bf16_x86)
    draft = LLMEngine(engine_dir, device="cpu", num_kv_blocks=64) if method == "draft" else None
    eng = LLMEngine(engine_dir, device="cpu", num_kv_blocks=64, enable_prefix_caching=False,
                    speculative=SpeculativeConfig(method, num_speculative_tokens=4,
                                                  draft_engine_dir="(loaded)" if draft else None,
                                                  step_overhead_tokens=float("inf")), draft_engine=draft)
    assert tokens(eng.generate(PROMPTS, PARAMS)) == alone
    assert eng.stats()["spec_accepted_tokens"] > 0
