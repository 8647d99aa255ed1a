"""The stub's GIL switch interval (model parameter gil_switch_interval_us, docs/serving.md
#per-token-work-beside-the-step) through a real tritonserver: the default and a set value reach
the stub (its load line names it), a bad value fails the load naming the parameter and the
allowed range while the other models keep serving; and repeated streams, whose responses come
from the delivery thread's Tensor cache, equal the first stream and the non-streamed result."""
from __future__ import annotations

import os
import re

import pytest

pytestmark = pytest.mark.slow  # starts tritonserver (as the other serving tests)

PROMPT = "naïve café — 日本語のテキスト 🙂 and the old mill"


@pytest.fixture(scope="module")
def server(tiny_engine, tmp_path_factory):
    from tritium.builder.repository import llm_config
    from tritium.client.serve.server import TritonServer
    engine = tiny_engine("llama")
    root = str(tmp_path_factory.mktemp("stub_gil"))
    repo = os.path.join(root, "repo")
    models = (("dflt", {}), ("si", {"gil_switch_interval_us": "200"}),
              ("bad_word", {"gil_switch_interval_us": "fast"}), ("bad_small", {"gil_switch_interval_us": "5"}))
    for name, params in models:
        os.makedirs(os.path.join(repo, name, "1"))
        with open(os.path.join(repo, name, "config.pbtxt"), "w") as f:
            f.write(llm_config(name, engine, 16, params))
    srv = TritonServer(repo, log_file=os.path.join(root, "server.log"), load_models=["dflt", "si"])
    srv.start(timeout=240)
    yield srv
    assert srv.stop() == 0


def test_switch_interval_reaches_the_stub(server):
    with open(server.log_file, encoding="utf-8", errors="replace") as f:
        log = f.read()
    got = dict(re.findall(r"model '(\w+)' serving engine .*?GIL switch interval (\d+) us", log))
    assert got == {"dflt": "5000", "si": "200"}, got


def test_bad_switch_interval_names_the_parameter(server):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException
    with grpcclient.InferenceServerClient(server.grpc_url) as c:
        for name, raw in (("bad_word", "'fast'"), ("bad_small", "'5'")):
            with pytest.raises(InferenceServerException,
                               match=re.escape(f"gil_switch_interval_us must be a number of microseconds in "
                                               f"[20, 100000], got {raw}")):
                c.load_model(name, headers=server.headers("grpc", admin=True))  # docs/security.md
            assert not c.is_model_ready(name)
        assert c.is_model_ready("dflt") and c.is_model_ready("si")


def test_repeated_streams_equal_the_first_and_the_whole(server):
    from tritium.client.triton_client import TritiumClient
    for model in ("dflt", "si"):
        c = TritiumClient(server.grpc_url, model=model)
        whole = c.generate(PROMPT, max_tokens=24, temperature=0.0)
        assert whole.num_output_tokens == len(whole.token_ids) >= 1
        streams = []
        for _ in range(3):  # the 2nd and 3rd streams' small outputs come from the Tensor cache
            chunks = list(c.stream(PROMPT, max_tokens=24, temperature=0.0))
            counts = [ch.num_output_tokens for ch in chunks if ch.token_ids]
            running = [sum(len(ch.token_ids) for ch in chunks[:i + 1]) for i, ch in enumerate(chunks) if ch.token_ids]
            assert counts == running
            streams.append(([t for ch in chunks for t in ch.token_ids], "".join(ch.text for ch in chunks)))
        assert streams[0] == streams[1] == streams[2] == (whole.token_ids, whole.text)
