"""Speculative decoding through a real tritonserver: two models of one tiny Llama engine, written
by the real `tritium build --repo ... --speculative ...` command (n-gram lookup with k = 5, and
the engine's bfloat16 build as a draft with k = 3). Greedy streams must equal the in-process
engine without speculation token for token, the spec counters must show on /metrics, and a
cancelled speculating stream must give back its KV blocks. A third model serves SmolLM2 (float32)
with the n-gram lookup, checked the same way on an input-grounded prompt."""
from __future__ import annotations

import os
import time

import pytest

from serving_utils import cancel_beside_others, metric, scrape, wait_for

pytestmark = pytest.mark.slow

PROMPTS = ["The quick brown fox jumps over the lazy dog. The quick brown fox",
           "Paged attention stores keys and values in fixed-size blocks. Paged attention",
           "naïve café — 日本語のテキスト 🙂 naïve café"]
MODELS = {"spec_ngram": ["--speculative", "ngram", "--num-speculative-tokens", "5"],
          "spec_draft": ["--speculative", "draft", "--num-speculative-tokens", "3"]}


SMOL_PROMPTS = [
    "<|im_start|>user\nSummarise in one sentence: The city council met on Tuesday to discuss the new park. "
    "The park would have a playground, a small lake and walking paths.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWhat is a good name for a cat?<|im_end|>\n<|im_start|>assistant\n"]


@pytest.fixture(scope="module")
def built(tiny_checkpoint, smollm2_engine, tmp_path_factory):
    from tritium.builder.repository import write_repository
    from tritium.client.cli.main import main
    root = tmp_path_factory.mktemp("spec-serving")
    repo, draft = str(root / "repo"), str(root / "draft")
    assert main(["build", tiny_checkpoint("llama"), "-o", draft, "--dtype", "bfloat16", "--quiet"]) == 0
    engines = {}
    for name, flags in MODELS.items():
        engine = str(root / f"engine_{name}")
        extra = ["--draft-engine", draft] if "draft" in flags else []
        assert main(["build", tiny_checkpoint("llama"), "-o", engine, "--dtype", "float32", "--quiet",
                     "--repo", repo, "--name", name] + flags + extra) == 0
        engines[name] = engine
    engines["smol_ngram"] = smollm2_engine("float32")
    write_repository(repo, "smol_ngram", engines["smol_ngram"],
                     engine_params={"speculative_method": "ngram", "num_speculative_tokens": "4"})
    return engines, repo, str(root)


@pytest.fixture(scope="module")
def server(built):
    from tritium.client.serve.server import TritonServer
    _, repo, root = built
    srv = TritonServer(repo, log_file=os.path.join(root, "server.log"), load_models=list(MODELS) + ["smol_ngram"])
    srv.start(timeout=240)
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def oracle(built):
    """Greedy tokens of the same engine in-process, without speculation."""
    from tritium.backend.engine import LLMEngine
    from tritium.backend.sampling_params import SamplingParams
    eng = LLMEngine(built[0]["spec_ngram"], device="cpu")

    def ref(prompt, max_tokens):
        out = eng.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0, min_tokens=max_tokens))[0]
        return list(out.outputs[0].token_ids)
    return ref


def client(server, model, protocol="grpc"):
    from tritium.client.triton_client import TritiumClient
    return TritiumClient(server.grpc_url if protocol == "grpc" else server.http_url, protocol=protocol, model=model)


def test_config_has_the_speculative_parameters(built):
    _, repo, _ = built
    with open(os.path.join(repo, "spec_draft", "config.pbtxt")) as f:
        text = f.read()
    assert 'key: "speculative_method" value { string_value: "draft" }' in text
    assert 'key: "num_speculative_tokens" value { string_value: "3" }' in text
    assert 'key: "draft_engine_dir"' in text


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_greedy_streams_equal_inprocess_without_speculation(server, oracle, model, protocol):
    c = client(server, model, protocol)
    for prompt in PROMPTS:
        ref = oracle(prompt, 40)
        chunks = list(c.stream(prompt, max_tokens=40, temperature=0.0, min_tokens=40))
        assert [t for ch in chunks for t in ch.token_ids] == ref, (model, prompt)
        assert sum(1 for ch in chunks if ch.finish_reason) == 1


def test_smollm2_greedy_stream_equals_inprocess_without_speculation(server, built):
    from tritium.backend.engine import LLMEngine
    from tritium.backend.sampling_params import SamplingParams
    eng = LLMEngine(built[0]["smol_ngram"], device="cpu", num_kv_blocks=64)
    for prompt in SMOL_PROMPTS:
        (ref,) = eng.generate([prompt], SamplingParams(max_tokens=32, temperature=0.0))
        chunks = list(client(server, "smol_ngram").stream(prompt, max_tokens=32, temperature=0.0))
        assert [t for ch in chunks for t in ch.token_ids] == ref.outputs[0].token_ids
    time.sleep(0.3)
    assert metric(scrape(server), "tritium_spec_accepted_tokens_total", model="smol_ngram") > 0


def test_spec_counters_on_metrics(server):
    time.sleep(0.3)  # metrics flush every 50 ms
    text = scrape(server)
    for model in MODELS:
        assert metric(text, "tritium_spec_proposed_tokens_total", model=model) > 0
    assert metric(text, "tritium_spec_accepted_tokens_total", model="spec_draft") > 0
    assert metric(text, "tritium_spec_accepted_tokens_total", model="spec_draft") <= \
        metric(text, "tritium_spec_proposed_tokens_total", model="spec_draft")


@pytest.mark.parametrize("model", list(MODELS))
def test_cancelled_speculating_stream_frees_kv_blocks(server, oracle, model):
    def used():
        return metric(scrape(server), "tritium_kv_cache_blocks", model=model, state="used")
    assert wait_for(lambda: used() == 0)
    others, errors = cancel_beside_others(lambda: client(server, model), lambda: client(server, model),
                                          [f"{PROMPTS[0]} {i}" for i in range(4)], 150, PROMPTS[1], 200)
    assert not errors and others == [150] * 4, (errors, others)
    assert wait_for(lambda: used() == 0), "a speculating request kept its KV blocks"
    assert client(server, model).generate(PROMPTS[0], max_tokens=20, temperature=0.0,
                                          min_tokens=20).token_ids == oracle(PROMPTS[0], 20)
