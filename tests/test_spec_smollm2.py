"""Speculative decoding on SmolLM2 (float32 build; its bfloat16 build drafts): greedy output equals
plain greedy decoding token for token, n-gram and draft proposers, k = 1..8, on an input-grounded
prompt (where the lookup's proposals are often right) and an open chat prompt.

The float32 engine is the one where "equal" is a fair demand: verification computes k + 1 query
rows per sequence, through GEMMs of another shape and the prefill attention path, and in
bfloat16 those round differently from one-row decodes (see docs/speculative.md, "Exactness")."""
import pytest

from tritium.backend.engine import LLMEngine
from tritium.backend.sampling_params import SamplingParams
from tritium.backend.speculative.config import SpeculativeConfig

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

DOC = ("The city council met on Tuesday to discuss the new park proposal. The proposal includes a playground, "
       "a small lake, and walking paths. Council member Smith said the park would cost about two million "
       "dollars. Council member Jones argued that the money should go to road repairs instead.")
PROMPTS = [f"<|im_start|>user\nSummarise this text in one sentence:\n{DOC}<|im_end|>\n<|im_start|>assistant\n",
           "<|im_start|>user\nWhat is a good name for a cat?<|im_end|>\n<|im_start|>assistant\n"]
PARAMS = SamplingParams(max_tokens=32, temperature=0.0)


@pytest.fixture(scope="module")
def plain(smollm2_engine):
    eng = LLMEngine(smollm2_engine("float32"), device="cpu", num_kv_blocks=64)
    return [o.outputs[0].token_ids for o in eng.generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_equals_plain_for_k_1_to_8(smollm2_engine, plain, method):
    loaded = LLMEngine(smollm2_engine("float32"), device="cpu", num_kv_blocks=1)
    draft = LLMEngine(smollm2_engine("bfloat16"), device="cpu", num_kv_blocks=8) if method == "draft" else None
    accepted = 0
    for k in range(1, 9):
        spec = SpeculativeConfig(method, num_speculative_tokens=k, draft_engine_dir="(loaded)" if draft else None,
                                 step_overhead_tokens=float("inf"))
        target = LLMEngine.from_model(loaded.config, loaded.runner.model, loaded.tokenizer, num_kv_blocks=64,
                                      speculative=spec, draft_engine=draft)
        outs = target.generate(PROMPTS, PARAMS)
        assert [o.outputs[0].token_ids for o in outs] == plain, (method, k)
        st = target.stats()
        accepted += st["spec_accepted_tokens"]
        assert st["kv_blocks_used"] == 0
    assert accepted > 0
