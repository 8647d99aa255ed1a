"""SmolLM2 (real byte-level BPE tokenizer): streamed deltas from the async engine join to exactly the
whole text, with multi-byte characters split across tokens; concurrent streams equal the sync engine."""
import threading

import pytest

from tritium.backend.async_engine import AsyncLLMEngine
from tritium.backend.engine import LLMEngine
from tritium.backend.sampling_params import SamplingParams

PROMPTS = [
    "<|im_start|>user\nWrite 'good morning' in Japanese and Chinese.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nList three emojis about the weather.<|im_end|>\n<|im_start|>assistant\n",
    "The French word for coffee is café, and the German word for over is über. In Japanese, hello is",
]


# Tiny models: intra-op threads only add barrier waits (see conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.slow
def test_streamed_deltas_join_to_whole_text(smollm2_engine):
    engine_dir = smollm2_engine("float32")
    params = SamplingParams(max_tokens=40, temperature=0.0)
    aengine = AsyncLLMEngine(engine_dir, device="cpu", num_kv_blocks=128)
    results = {}

    def consume(i):
        deltas, last = [], None
        for out in aengine.generate(f"p{i}", prompt=PROMPTS[i], params=params):
            deltas.append(out.outputs[0].text_delta)
            last = out
        results[i] = (deltas, last)

    try:
        threads = [threading.Thread(target=consume, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        stats = aengine.stats()
    finally:
        aengine.shutdown()
    tok = aengine.tokenizer
    split_chars = 0
    for i in range(len(PROMPTS)):
        deltas, last = results[i]
        comp = last.outputs[0]
        whole = tok.decode(comp.token_ids, skip_special_tokens=True)
        assert "".join(deltas).encode("utf-8") == whole.encode("utf-8") == comp.text.encode("utf-8")
        if "\ufffd" not in whole:
            assert all("\ufffd" not in d for d in deltas)
        split_chars += sum("\ufffd" in tok.decode([t]) for t in comp.token_ids)
    assert split_chars > 0, "no multi-byte character was split across tokens: the test proves nothing"
    assert any(any(ord(c) > 127 for c in results[i][1].outputs[0].text) for i in results)
    assert stats["kv_blocks_used"] == 0
    # The concurrent streams produced what the synchronous engine produces for the same batch.
    sync = LLMEngine(engine_dir, device="cpu", num_kv_blocks=128).generate(PROMPTS, params)
    for i, out in enumerate(sync):
        assert out.outputs[0].token_ids == results[i][1].outputs[0].token_ids
