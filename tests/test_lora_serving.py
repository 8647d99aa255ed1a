"""LoRA through a real tritonserver (one server for the module): each adapter's greedy output over
gRPC (the LLM model and the ensemble), tensorrtllm_backend's lora_task_id tensors, and the OpenAI
API through the official `openai` package equal the in-process engine's; bad adapters fail only
their request; per-adapter metrics count."""
from __future__ import annotations

import os

import pytest
import torch

from lora_utils import make_peft_adapter
from serving_utils import metric, scrape, wait_for

pytestmark = pytest.mark.slow

NAME = "tiny"
ADAPTERS = {"sql": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                           "up_proj", "down_proj"]),
            "chat": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_rslora=True),
            "code": dict(r=16, lora_alpha=8, target_modules=["gate_proj", "down_proj"])}
PROMPTS = ["The quick brown fox", "Paged attention stores keys"]


@pytest.fixture(scope="module")
def built(tiny_checkpoint, tmp_path_factory):
    """(engine, repo, root, adapter folders) from `tritium build --repo --lora ...`."""
    from transformers import AutoModelForCausalLM

    from tritium.client.cli.main import main
    root = tmp_path_factory.mktemp("lora-serving")
    paths = {}
    for i, (name, kw) in enumerate(ADAPTERS.items()):
        base = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("llama"), dtype=torch.float32)
        paths[name] = str(root / f"adapter-{name}")
        make_peft_adapter(base, paths[name], seed=10 + i, **kw)
    engine, repo = str(root / "engine"), str(root / "repo")
    lora = [a for n, p in paths.items() for a in ("--lora", f"{n}={p}")]
    assert main(["build", tiny_checkpoint("llama"), "-o", engine, "--dtype", "float32", "--max-batch-size", "16",
                 "--quiet", "--repo", repo, "--name", NAME, *lora]) == 0
    return engine, repo, str(root), paths


@pytest.fixture(scope="module")
def server(built):
    from tritium.client.serve.server import TritonServer, prepare_backend_dir
    engine, repo, root, _ = built
    models = [NAME, f"{NAME}_preprocessing", f"{NAME}_postprocessing", f"{NAME}_ensemble"]
    # A backend folder of its own: the shared cache's tritium/model.py is rewritten by whichever
    # checkout started a server last, which may be one whose model.py does not pass adapters on.
    srv = TritonServer(repo, log_file=os.path.join(root, "server.log"), load_models=models,
                       backend_dir=prepare_backend_dir(os.path.join(root, "backends")))
    srv.start(timeout=240)
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def oracle(built):
    """(prompt, adapter or None, max_tokens) -> (token ids, text) from the in-process engine."""
    from tritium.backend.engine import LLMEngine
    from tritium.backend.lora.manager import LoRAConfig
    from tritium.backend.sampling_params import SamplingParams
    eng = LLMEngine(built[0], device="cpu", lora=LoRAConfig(built[3]))
    cache = {}

    def ref(prompt, lora, max_tokens=12):
        key = (prompt, lora, max_tokens)
        if key not in cache:
            out = eng.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0), lora_names=lora)[0]
            cache[key] = (list(out.outputs[0].token_ids), out.outputs[0].text)
        return cache[key]
    ref.engine = eng
    return ref


def _client(server, model=NAME):
    from tritium.client.triton_client import TritiumClient
    return TritiumClient(server.grpc_url, protocol="grpc", model=model)


@pytest.mark.parametrize("model", [NAME, f"{NAME}_ensemble"])
def test_each_adapter_over_grpc_equals_inprocess(server, oracle, model):
    import json
    c = _client(server, model)
    outs = set()
    for lora in (None, "sql", "chat", "code"):
        for prompt in PROMPTS:
            sp = json.dumps({"lora_name": lora}) if lora else None
            got = c.generate(prompt, max_tokens=12, temperature=0.0, sampling_parameters=sp)
            assert got.token_ids == oracle(prompt, lora)[0], (model, lora, prompt)
            outs.add(tuple(got.token_ids))
    assert len(outs) >= 6  # the adapters really change the output


def test_trtllm_lora_task_id_tensors(server, oracle, built):
    from test_lora_peft import trtllm_tensors
    from tritium.backend.sampling_params import SamplingParams
    c = _client(server)
    w, cfg = trtllm_tensors(built[3]["chat"])  # float16, as tensorrtllm_backend sends them
    eng = oracle.engine
    eng.lora.register_task(41, w, cfg)

    def ref(prompt):  # the in-process engine with the same (fp16-rounded) adapter
        ids = eng.tokenizer.encode(prompt).ids
        eng.add_request(f"ref-{prompt}", prompt_token_ids=ids, params=SamplingParams(max_tokens=12, temperature=0.0),
                        lora_task_id=41)
        while eng.has_unfinished():
            for out in eng.step():
                if out.finished:
                    return out.outputs[0].token_ids
    first = c.generate(PROMPTS[0], max_tokens=12, temperature=0.0, lora_task_id=41, lora_weights=w[0], lora_config=cfg[0])
    assert first.token_ids == ref(PROMPTS[0])
    again = c.generate(PROMPTS[1], max_tokens=12, temperature=0.0, lora_task_id=41)  # cached under its id
    assert again.token_ids == ref(PROMPTS[1])
    from tritium.client.triton_client import TritiumClientError
    with pytest.raises(TritiumClientError, match="lora_task_id 42 is not in the LoRA cache"):
        c.generate(PROMPTS[0], max_tokens=4, lora_task_id=42)


@pytest.mark.parametrize("sp, reason", [
    ('{"lora_name": "nope"}', "unknown LoRA adapter 'nope'; this model serves: chat, code, sql"),
    ('{"lora_name": 5}', "lora_name must be a string, got 5"),
])
def test_bad_adapter_fails_only_that_request(server, oracle, sp, reason):
    from tritium.client.triton_client import TritiumClientError
    c = _client(server)
    with pytest.raises(TritiumClientError, match=reason):
        c.generate(PROMPTS[0], max_tokens=4, sampling_parameters=sp)
    assert c.generate(PROMPTS[0], max_tokens=12, temperature=0.0).token_ids == oracle(PROMPTS[0], None)[0]


def test_openai_api_serves_each_adapter_as_a_model(server, oracle):
    import openai

    from tritium.client.openai.openai_server import OpenAIServer
    api = OpenAIServer(server.grpc_url, port=0, security=server.security).start()
    try:
        client = openai.OpenAI(base_url=api.url, api_key="unused", max_retries=0, timeout=120)
        cards = {m.id: m for m in client.models.list().data}
        assert set(cards) == {NAME, "sql", "chat", "code"}
        assert all(cards[a].model_extra["parent"] == NAME for a in ("sql", "chat", "code"))
        for lora in ("sql", "chat", "code"):
            r = client.completions.create(model=lora, prompt=PROMPTS[0], max_tokens=12, temperature=0)
            assert r.choices[0].text == oracle(PROMPTS[0], lora)[1], lora
        r = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=12, temperature=0)
        assert r.choices[0].text == oracle(PROMPTS[0], None)[1]
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="nope", prompt="x", max_tokens=2)
    finally:
        api.stop()


def test_per_adapter_metrics(server):
    c = _client(server)
    import json
    c.generate(PROMPTS[0], max_tokens=5, temperature=0.0, sampling_parameters=json.dumps({"lora_name": "code"}))
    assert wait_for(lambda: "tritium_lora_generation_tokens_total" in scrape(server))
    text = scrape(server)
    assert metric(text, "tritium_lora_requests_total", model=NAME, adapter="code") >= 1
    assert metric(text, "tritium_lora_generation_tokens_total", model=NAME, adapter="code") >= 5
    assert metric(text, "tritium_lora_prompt_tokens_total", model=NAME, adapter="code") >= 1
    with pytest.raises(AssertionError, match="not in /metrics"):  # labelled per adapter: none for one never asked
        metric(text, "tritium_lora_requests_total", adapter="never-served")
