"""An int4 Qwen3-MoE engine (experts int4 GPTQ, calibrated per expert) built by the real `tritium
build` command and served by `tritium serve` (tritonserver + the OpenAI API): greedy tokens and
text over tritonclient gRPC and through the official `openai` package equal the in-process
engine's (the oracle, run here, never the server under test)."""
from __future__ import annotations

import os
import re

import pytest

import test_models_moe  # noqa: F401 (registers the tiny MoE families in tiny_models.FAMILIES)
from serving_utils import tritium_serve

pytestmark = pytest.mark.slow

PROMPTS = ["In the beginning God created the heaven and the earth.", "naïve café — 東京 🙂"]


def test_int4_qwen3_moe_serves_through_tritonserver_and_openai(tiny_checkpoint, tmp_path_factory):
    import openai

    from tritium.backend.engine import LLMEngine
    from tritium.backend.loader import load_engine
    from tritium.backend.sampling_params import SamplingParams
    from tritium.client.cli.main import main
    from tritium.client.triton_client import TritiumClient
    root = tmp_path_factory.mktemp("moe-serve")
    engine, repo = str(root / "engine"), str(root / "repo")
    assert main(["build", tiny_checkpoint("qwen3_moe"), "-o", engine, "--dtype", "float32", "--quantization",
                 "int4-gptq", "--calibration-samples", "4", "--eval-tokens", "0", "--quiet", "--repo", repo,
                 "--name", "moe"]) == 0
    cfg, _, _ = load_engine(engine, "cpu")
    assert cfg.quantization.layers["layers.1.experts.gate_up"].method == "int4"
    assert cfg.quantization.layers["layers.2.experts.down"].method == "int4"
    eng = LLMEngine(engine, device="cpu", num_kv_blocks=64)
    refs = eng.generate(PROMPTS, SamplingParams(max_tokens=10, min_tokens=10, temperature=0.0))
    env = dict(os.environ, TRITIUM_CACHE=str(root / "cache"))
    with tritium_serve(repo, root, env=env) as (_, lines):
        text = "".join(lines)
        grpc_url = re.search(r"gRPC (\S+)", text).group(1)
        openai_url = re.search(r"OpenAI API: (\S+)", text).group(1)
        client = TritiumClient(grpc_url, protocol="grpc", model="moe", timeout=120)
        oai = openai.OpenAI(base_url=openai_url, api_key="unused", max_retries=0, timeout=120)
        for prompt, ref in zip(PROMPTS, refs):
            want = ref.outputs[0]
            assert len(want.token_ids) == 10
            got = client.generate(prompt, max_tokens=10, min_tokens=10, temperature=0.0)
            assert got.token_ids == want.token_ids and got.text == want.text, prompt
            c = oai.completions.create(model="moe", prompt=prompt, max_tokens=10, temperature=0.0,
                                       extra_body={"min_tokens": 10})
            assert c.choices[0].text == want.text, prompt
            assert c.usage.completion_tokens == 10
