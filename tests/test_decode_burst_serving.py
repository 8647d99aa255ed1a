"""Decode bursts through a real tritonserver (tritonclient gRPC streaming and Triton's HTTP
generate_stream): a bf16 tiny engine served twice, with bursts (max_decode_burst 8) and without
(max_decode_burst 1). A streamed request's tokens concatenated equal the burst-off model's and the
in-process engine's greedy result, its text likewise, every response's num_output_tokens is the
running count, the counts add up to max_tokens, and the burst model's responses carry several
tokens each (the burst-off model's one)."""
from __future__ import annotations

import json
import os
import threading
import urllib.request

import numpy as np
import pytest
from serving_utils import greedy_stream

from tritium.backend.engine import LLMEngine
from tritium.backend.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # starts tritonserver

SMALL = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
PROMPTS = ["the old mill by the river", "naïve café 🙂", "a"]
MAX_TOKENS = 37  # not a multiple of the burst


@pytest.fixture(scope="module")
def served(tiny_checkpoint, tmp_path_factory):
    from tritium.builder.build import BuildOptions, build_engine
    from tritium.builder.repository import llm_config
    from tritium.client.serve.server import TritonServer
    root = str(tmp_path_factory.mktemp("burst-serving"))
    engine = os.path.join(root, "engine")
    build_engine(BuildOptions(source=tiny_checkpoint("llama", **SMALL), output=engine, dtype="bfloat16",
                              quantization="int8", progress=False))
    repo = os.path.join(root, "repo")
    for name, burst in (("burst", "8"), ("steps", "1")):
        os.makedirs(os.path.join(repo, name, "1"))
        with open(os.path.join(repo, name, "config.pbtxt"), "w") as f:
            f.write(llm_config(name, engine, 8, {"max_decode_burst": burst}))
    env = os.environ.pop("TRITIUM_DECODE_BURST", None)  # the parameters decide here
    srv = TritonServer(repo, log_file=os.path.join(root, "server.log"), load_models=["burst", "steps"])
    try:
        srv.start(timeout=240)
        yield engine, srv
        assert srv.stop() == 0
    finally:
        if env is not None:
            os.environ["TRITIUM_DECODE_BURST"] = env


def _grpc(srv, model, prompt):
    """[(output_ids, text, num_output_tokens)] of each streamed response that carried outputs."""
    return greedy_stream(srv.grpc_url, model, prompt, MAX_TOKENS, headers=srv.headers("grpc"))


def _http(srv, model, prompt):
    """The same through Triton's HTTP generate_stream (server-sent events)."""
    body = json.dumps({"text_input": prompt, "max_tokens": MAX_TOKENS, "stream": True, "temperature": 0.0,
                       "sampling_parameters": '{"ignore_eos": true}'}).encode()
    got = []
    with srv.urlopen(f"/v2/models/{model}/generate_stream", data=body, timeout=120) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data:"):
                continue
            d = json.loads(line[5:])
            assert "error" not in d, d
            ids = d.get("output_ids")
            ids = [] if ids is None else ids if isinstance(ids, list) else [ids]
            if ids or d.get("text_output"):
                got.append((ids, d.get("text_output") or "", int(d["num_output_tokens"])))
    return got


def _check(responses, want_ids, want_text):
    ids = [t for r in responses for t in r[0]]
    assert ids == want_ids
    assert "".join(r[1] for r in responses) == want_text
    assert [r[2] for r in responses] == np.cumsum([len(r[0]) for r in responses]).tolist()
    assert responses[-1][2] == MAX_TOKENS
    return [len(r[0]) for r in responses]


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_streamed_bursts_equal_steps(served, protocol):
    engine, srv = served
    call = _grpc if protocol == "grpc" else _http
    ref = LLMEngine(engine, max_decode_burst=1)
    for prompt in PROMPTS:
        want = ref.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))[0]
        want_ids, want_text = list(want.outputs[0].token_ids), want.outputs[0].text
        steps = _check(call(srv, "steps", prompt), want_ids, want_text)
        burst = _check(call(srv, "burst", prompt), want_ids, want_text)
        assert set(steps) == {1}
        assert max(burst) > 1 and len(burst) < len(steps), burst


def test_concurrent_streams_with_bursts(served):
    """Three streams at once (decode-only batches of several rows burst together)."""
    engine, srv = served
    ref = LLMEngine(engine, max_decode_burst=1)
    want = ref.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    got, errors = [None] * len(PROMPTS), []
    barrier = threading.Barrier(len(PROMPTS))

    def run(i):
        try:
            barrier.wait()
            got[i] = _grpc(srv, "burst", PROMPTS[i])
        except Exception as e:  # reported below
            errors.append(e)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    for i, responses in enumerate(got):
        _check(responses, list(want[i].outputs[0].token_ids), want[i].outputs[0].text)
