"""Coalesced responses: when the backend's delivery thread falls behind the engine, a stream's
queued tokens go out in one response (backend/async_engine.coalesce_outputs). Checked in-process
against LLMEngine's greedy generate (a slow consumer forces the lag), and through a real
tritonserver with tritonclient: under 16 concurrent streams of a tiny model (sub-millisecond
steps, so delivery lags) the concatenated stream of every request equals its non-streamed result,
ids and text, and every response's num_output_tokens is the running count: no token lost or
duplicated; `coalesce_responses false` (the default) sends one token per response."""
from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
from serving_utils import greedy_stream

from tritium.backend.async_engine import AsyncLLMEngine, merge_outputs
from tritium.backend.sampling_params import SamplingParams
from tritium.backend.sequence import CompletionOutput, RequestOutput

pytestmark = pytest.mark.slow  # starts tritonserver (as the other serving tests)

PROMPTS = [f"naïve café — 日本語のテキスト 🙂 and more #{i}" for i in range(4)]


def _slow_consumer_run(engine_dir, coalesce: bool):
    eng = AsyncLLMEngine(engine_dir, coalesce=coalesce)
    got = {i: [] for i in range(4)}
    done = threading.Event()
    left = [4]

    def on_output(i):
        def cb(out):
            time.sleep(0.005)  # slower than a tiny model's step: the queue fills behind us
            got[i].append(out)
            if out.finished:
                left[0] -= 1
                if not left[0]:
                    done.set()
        return cb
    try:
        for i in range(4):
            ids = eng.tokenizer.encode(PROMPTS[i]).ids
            eng.submit(f"r{i}", ids, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), on_output(i))
        assert done.wait(120)
        return got, eng.num_coalesced
    finally:
        eng.shutdown()


def test_lagging_delivery_coalesces_and_loses_nothing(tiny_engine):
    from tritium.backend.engine import LLMEngine
    engine_dir = tiny_engine("llama")
    ref = LLMEngine(engine_dir)
    for coalesce in (True, False):
        got, merged = _slow_consumer_run(engine_dir, coalesce)
        for i, outs in got.items():
            want = ref.generate([PROMPTS[i]], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))[0]
            ids = [t for o in outs for t in o.outputs[0].new_token_ids]
            assert ids == list(want.outputs[0].token_ids)
            assert "".join(o.outputs[0].text_delta for o in outs) == want.outputs[0].text
            assert [o.finished for o in outs].count(True) == 1 and outs[-1].finished
            assert list(outs[-1].outputs[0].token_ids) == ids
        if coalesce:
            assert merged > 0 and any(len(o.outputs[0].new_token_ids) > 1 for outs in got.values() for o in outs)
        else:
            assert merged == 0 and all(len(o.outputs[0].new_token_ids) == 1 for outs in got.values() for o in outs)


def test_merge_outputs_joins_new_tokens_per_sample():
    def c(i, new, text, allids, fin=None):
        return CompletionOutput(index=i, text=text, text_delta=text[-len(new):] if new else "", token_ids=allids,
                                new_token_ids=new, finish_reason=fin)
    a = RequestOutput("r", [1], False, [c(0, [5], "ab", [5]), c(1, [7], "x", [7])])
    b = RequestOutput("r", [1], True, [c(0, [6], "abc", [5, 6], "length")])
    m = merge_outputs(a, b)
    assert m.finished and [o.index for o in m.outputs] == [0, 1]
    assert m.outputs[0].new_token_ids == [5, 6] and m.outputs[0].token_ids == [5, 6]
    assert m.outputs[0].text_delta == "b" + "c" and m.outputs[0].finish_reason == "length"
    assert m.outputs[1] is a.outputs[1]  # a sample only the first step reported stays as it was


# ---- through tritonserver -------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tiny_engine, tmp_path_factory):
    from tritium.builder.repository import llm_config
    from tritium.client.serve.server import TritonServer
    engine = tiny_engine("llama")
    root = str(tmp_path_factory.mktemp("coalesce"))
    repo = os.path.join(root, "repo")
    for name, params in (("on", {"coalesce_responses": "true"}), ("off", {}), ("bad", {"coalesce_responses": "maybe"})):
        os.makedirs(os.path.join(repo, name, "1"))
        with open(os.path.join(repo, name, "config.pbtxt"), "w") as f:
            f.write(llm_config(name, engine, 16, params))
    srv = TritonServer(repo, log_file=os.path.join(root, "server.log"), load_models=["on", "off"])
    srv.start(timeout=240)
    yield srv
    assert srv.stop() == 0


def _request(url, model, prompt, stream: bool, max_tokens=48):
    """[(output_ids, text, num_output_tokens)] of each response that carried outputs."""
    return greedy_stream(url, model, prompt, max_tokens, stream=stream)


def test_concurrent_streams_equal_non_streamed_results(server):
    prompts = [f"Passage {i}: naïve café — 日本語 🙂 and the old mill" for i in range(16)]
    for model in ("on", "off"):
        want = [_request(server.grpc_url, model, p, stream=False) for p in prompts[:4]]
        got, errors = [None] * 16, []
        barrier = threading.Barrier(16)

        def run(i):
            try:
                barrier.wait()
                got[i] = _request(server.grpc_url, model, prompts[i], stream=True)
            except Exception as e:  # reported below
                errors.append(e)
        threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not errors, errors
        for i, responses in enumerate(got):
            ids = [t for r in responses for t in r[0]]
            assert len(ids) == 48
            running = np.cumsum([len(r[0]) for r in responses]).tolist()
            assert [r[2] for r in responses] == running  # each response counts every token so far
            if i < 4:
                assert len(want[i]) == 1
                assert ids == want[i][0][0] and "".join(r[1] for r in responses) == want[i][0][1]
        sizes = [len(r[0]) for responses in got for r in responses]
        if model == "off":
            assert set(sizes) == {1}
        print(f"{model}: {len(sizes)} responses for {sum(sizes)} tokens, largest {max(sizes)}")


def test_bad_coalesce_parameter_names_it(server):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException
    with grpcclient.InferenceServerClient(server.grpc_url) as c:
        with pytest.raises(InferenceServerException, match="coalesce_responses must be true or false, got 'maybe'"):
            c.load_model("bad", headers=server.headers("grpc", admin=True))  # docs/security.md
        assert not c.is_model_ready("bad") and c.is_model_ready("on")
