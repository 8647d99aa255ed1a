"""Decode bursts through a real tritonserver (tritonclient gRPC streaming and Triton's HTTP
generate_stream): a bf16 tiny engine served twice, with bursts (max_decode_burst 8) and without
(max_decode_burst 1). A streamed request's tokens concatenated equal the burst-off model's and the
in-process engine's greedy result, its text likewise, every response's num_output_tokens is the
running count, the counts add up to max_tokens, and the burst model's responses carry several
tokens each (the burst-off model's one)."""
from __future__ import annotations

import json
import os
import queue
import threading
import urllib.request

import numpy as np
import pytest

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
    cwd = os.getcwd()
    try:
        os.chdir(_tree_root())
        try:
            srv.start(timeout=240)
        finally:
            os.chdir(cwd)
        yield engine, srv
        assert srv.stop() == 0
    finally:
        if env is not None:
            os.environ["TRITIUM_DECODE_BURST"] = env


def _tree_root() -> str:
    """The folder the backend stub must start in to import this test's `tritium`: the stub's
    Python ignores PYTHONPATH (its sys.path: '' (its working directory), the standard library,
    the environment's site-packages with the editable install's finder), so a worktree whose
    package sits in a folder on PYTHONPATH (a namespace `tritium` of links) would otherwise serve
    the editable install's code. Where `tritium` is the editable install itself: the current folder."""
    import tritium
    for entry in list(tritium.__path__):
        parent = os.path.dirname(entry)
        if os.path.isdir(os.path.join(parent, "tritium", "backend")):
            return parent
    return os.getcwd()


def _grpc(srv, model, prompt):
    """[(output_ids, text, num_output_tokens)] of each streamed response that carried outputs."""
    import tritonclient.grpc as grpcclient
    results = queue.Queue()
    cl = grpcclient.InferenceServerClient(srv.grpc_url)
    cl.start_stream(callback=lambda result, error: results.put((result, error)), headers=srv.headers("grpc"))
    fields = {"text_input": (np.array([[prompt.encode()]], dtype=np.object_), "BYTES"),
              "max_tokens": (np.array([[MAX_TOKENS]], dtype=np.int32), "INT32"),
              "stream": (np.array([[True]], dtype=np.bool_), "BOOL"),
              "temperature": (np.array([[0.0]], dtype=np.float32), "FP32"),
              "sampling_parameters": (np.array([[b'{"ignore_eos": true}']], dtype=np.object_), "BYTES")}
    inputs = []
    for name, (arr, dtype) in fields.items():
        inp = grpcclient.InferInput(name, list(arr.shape), dtype)
        inp.set_data_from_numpy(arr)
        inputs.append(inp)
    outs = [grpcclient.InferRequestedOutput(n) for n in ("output_ids", "text_output", "num_output_tokens")]
    cl.async_stream_infer(model, inputs, outputs=outs, enable_empty_final_response=True)
    got = []
    try:
        while True:
            r, e = results.get(timeout=120)
            assert e is None, e
            if r.get_response().outputs:
                got.append((r.as_numpy("output_ids").reshape(-1).tolist(),
                            r.as_numpy("text_output").reshape(-1)[0].decode(),
                            int(r.as_numpy("num_output_tokens").reshape(-1)[0])))
            if r.get_response().parameters["triton_final_response"].bool_param:
                return got
    finally:
        cl.stop_stream()
        cl.close()


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
