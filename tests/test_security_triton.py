"""Secure by default, against the real tritonserver: with the default settings the model-repository,
model-config, shared-memory, trace and logging APIs are refused on the public HTTP port (the guard)
and on gRPC (tritonserver's restricted protocols), the model still loads at start and serves, and
the same calls work with the admin key. Then the hostile-client suite (tests/hostile_cases.py)
on Triton HTTP, Triton gRPC and the OpenAI API of the same server: every answer is a 4xx or a
503 naming the field, the server keeps serving and every KV block comes back.

One server for the module (TritonServer with no security settings = the defaults of `tritium
serve`), with the OpenAI API in this process in front of it. Oracles: tritonclient (gRPC, HTTP)
and raw HTTP against the real server; the server's own /metrics for the KV blocks.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import time

import numpy as np
import pytest

from hostile_cases import MODEL, Tally, error_text, openai_cases, request
from serving_utils import metric, scrape, wait_for

pytestmark = pytest.mark.slow
WRONG = "w" * 32
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
TALLY = Tally()


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("security")


@pytest.fixture(scope="module")
def server(tiny_engine, root):
    from tritium.builder.repository import write_repository
    from tritium.client.serve.server import TritonServer
    repo, engine = str(root / "repo"), str(root / "engine")
    shutil.copytree(tiny_engine("llama", max_batch_size=8), engine)
    with open(os.path.join(engine, "chat_template.jinja"), "w") as f:  # so that chat requests get parsed
        f.write(CHATML)
    write_repository(repo, MODEL, engine)
    srv = TritonServer(repo, log_file=str(root / "server.log"), load_models=[MODEL])  # the defaults
    srv.start(timeout=240)
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def openai_url(server):
    from tritium.client.openai.openai_server import OpenAIServer
    api = OpenAIServer(server.grpc_url, port=0, security=server.security).start()
    yield f"http://127.0.0.1:{api.port}"
    api.stop()


def _grpc(server):
    import tritonclient.grpc as grpcclient
    return grpcclient.InferenceServerClient(server.grpc_url)


def _http(server, url=None):
    import tritonclient.http as httpclient
    return httpclient.InferenceServerClient(url or server.http_url)


def _evil(marker: str):
    """A Python model whose initialize() writes `marker`: what a file override uploads."""
    config = json.dumps({"name": "evil", "backend": "python", "max_batch_size": 0,
                         "input": [{"name": "X", "data_type": "TYPE_INT32", "dims": [1]}],
                         "output": [{"name": "Y", "data_type": "TYPE_INT32", "dims": [1]}]})
    code = ("import pathlib\n\nclass TritonPythonModel:\n    def initialize(self, args):\n"
            f"        pathlib.Path({marker!r}).write_text('code ran')\n\n    def execute(self, requests):\n"
            "        return []\n").encode()
    return config, {"file:1/model.py": code}


def _refused(fn, *args, **kw) -> str:
    from tritonclient.utils import InferenceServerException
    with pytest.raises(InferenceServerException) as e:
        fn(*args, **kw)
    return str(e.value)


# ---- the "must show": refused by default, a model still loads, works with the admin key -----------
def test_model_loads_at_start_and_serves_without_a_key(server):
    from tritium.client.triton_client import TritiumClient
    assert _grpc(server).is_model_ready(MODEL)
    for protocol, url in (("grpc", server.grpc_url), ("http", server.http_url)):
        out = TritiumClient(url, protocol=protocol, model=MODEL, api_key="").generate("Hello", max_tokens=3,
                                                                                      temperature=0.0)
        assert out.num_output_tokens == 3


def test_load_model_with_a_file_override_is_refused(server, root):
    marker = str(root / "evil_ran")
    config, files = _evil(marker)
    msg = _refused(_grpc(server).load_model, "evil", config=config, files=files)
    assert "restricted" in msg and "tritium-admin-key" in msg
    TALLY.add("triton-grpc admin", "refused")
    msg = _refused(_http(server).load_model, "evil", config=config, files=files)
    assert "[403]" in msg and "disabled on this port" in msg and "--admin-key" in msg
    TALLY.add("triton-http admin", 403)
    # tritonserver's own HTTP port (loopback, behind the guard) refuses it too
    msg = _refused(_http(server, server.triton_http_url).load_model, "evil", config=config, files=files)
    assert "[403]" in msg and "restricted" in msg
    time.sleep(1.0)
    assert not os.path.exists(marker), "the uploaded code ran"
    assert not _grpc(server).is_model_ready("evil")


def test_register_system_shared_memory_is_refused(server):
    import tritonclient.utils.shared_memory as shm
    key = f"/tritium_sec_{os.getpid()}"
    handle = shm.create_shared_memory_region("sec_region", key, 64)
    try:
        msg = _refused(_grpc(server).register_system_shared_memory, "r", key, 64)
        assert "restricted" in msg
        msg = _refused(_http(server).register_system_shared_memory, "r", key, 64)
        assert "[403]" in msg and "shared-memory" in msg
        # a region of the Python backend's own, named by prefix, is refused the same way
        msg = _refused(_grpc(server).register_system_shared_memory, "py", server.shm_prefix, 64)
        assert "restricted" in msg
    finally:
        shm.destroy_shared_memory_region(handle)
    TALLY.add("triton-grpc admin", "refused")
    TALLY.add("triton-http admin", 403)


def test_the_same_calls_work_with_the_admin_key(server, root):
    import tritonclient.utils.shared_memory as shm
    marker = str(root / "evil_admin_ran")
    config, files = _evil(marker)
    g, h = _grpc(server), _http(server)
    gh, hh = server.headers("grpc", admin=True), server.headers("http", admin=True)
    keys = [f"/tritium_sec_admin{i}_{os.getpid()}" for i in (1, 2)]
    handles = [shm.create_shared_memory_region(f"sec_admin{i}", k, 64) for i, k in enumerate(keys)]
    try:
        g.register_system_shared_memory("r1", keys[0], 64, headers=gh)
        h.register_system_shared_memory("r2", keys[1], 64, headers=hh)
        status = g.get_system_shared_memory_status(headers=gh, as_json=True)
        assert {"r1", "r2"} <= set(status.get("regions", {}))
        g.unregister_system_shared_memory(headers=gh)
    finally:
        for handle in handles:
            shm.destroy_shared_memory_region(handle)
    g.load_model("evil", config=config, files=files, headers=gh)  # an operator's reload path
    try:
        assert g.is_model_ready("evil") and os.path.exists(marker)
    finally:
        h.unload_model("evil", headers=hh)
    assert wait_for(lambda: not g.is_model_ready("evil"), timeout=30)
    assert h.get_model_config(MODEL, headers=hh)["backend"] == "tritium"


# ---- hostile clients: Triton's admin APIs, every route, with no key and a wrong one ----------------
ADMIN_HTTP = [("POST", "/v2/repository/index"), ("POST", "/v2/repository/models/tiny/load"),
              ("POST", "/v2/repository/models/tiny/unload"), ("GET", "/v2/models/tiny/config"),
              ("GET", "/v2/models/tiny/versions/1/config"), ("GET", "/v2/systemsharedmemory/status"),
              ("POST", "/v2/systemsharedmemory/region/x/register"), ("POST", "/v2/systemsharedmemory/unregister"),
              ("GET", "/v2/cudasharedmemory/status"), ("POST", "/v2/cudasharedmemory/region/x/register"),
              ("GET", "/v2/trace/setting"), ("POST", "/v2/trace/setting"), ("GET", "/v2/models/tiny/trace/setting"),
              ("GET", "/v2/logging"), ("POST", "/v2/logging"), ("POST", "/v2/repository//index"),
              ("POST", "/v2/repository/models/tiny/load?x=1")]
ODD_PATHS = ["//v2/repository/index", "/v2/%72epository/index", "/V2/repository/index", "/v2/models/tiny/../config",
             "/v2/models/tiny/versions/x/config", "/", "/metrics"]


def test_admin_http_routes_refused_without_the_key(server):
    body = json.dumps({"parameters": {"config": "{}", "file:1/model.py": "aW1wb3J0IG9z"},
                       "log_file": "/tmp/x", "trace_file": "/tmp/y"}).encode()
    for headers in ({}, {"tritium-admin-key": WRONG}, {"Authorization": f"Bearer {WRONG}"}):
        for method, path in ADMIN_HTTP:
            status, out, raw = request(server.http_url, method, path, body if method == "POST" else None, headers)
            TALLY.add("triton-http admin", status)
            assert status == 403 and "tritium-admin-key" in error_text(out), (method, path, status, raw[:200])
        for path in ODD_PATHS:
            status, out, raw = request(server.http_url, "POST", path, body, headers)
            TALLY.add("triton-http admin", status)
            assert status == 404 and "not a Triton HTTP route" in error_text(out), (path, status, raw[:200])
    # the admin key opens them (GET ones: nothing changes)
    for method, path in ADMIN_HTTP:
        if method == "GET" and "cuda" not in path:
            status, out, raw = request(server.http_url, method, path, None, server.headers("http", admin=True))
            TALLY.add("triton-http admin (key)", status)
            assert status == 200, (path, status, raw[:200])


def test_admin_grpc_calls_refused_without_the_key(server):
    g = _grpc(server)
    calls = [("get_model_repository_index", ()), ("get_model_config", (MODEL,)), ("unload_model", (MODEL,)),
             ("load_model", (MODEL,)), ("get_system_shared_memory_status", ()),
             ("register_system_shared_memory", ("x", "/x", 8)), ("unregister_system_shared_memory", ()),
             ("get_cuda_shared_memory_status", ()), ("register_cuda_shared_memory", ("x", b"\0" * 64, 0, 8)),
             ("get_trace_settings", ()), ("update_trace_settings", (MODEL, {"trace_file": "/tmp/x"})),
             ("get_log_settings", ()), ("update_log_settings", ({"log_file": "/tmp/x"},))]
    for headers in (None, {"triton-grpc-protocol-tritium-admin-key": WRONG}, {"tritium-admin-key": WRONG}):
        for name, args in calls:
            msg = _refused(getattr(g, name), *args, headers=headers)
            TALLY.add("triton-grpc admin", "refused")
            assert "restricted" in msg and "tritium-admin-key" in msg, (name, msg)
    assert g.is_model_ready(MODEL)
    assert g.get_model_repository_index(headers=server.headers("grpc", admin=True))


# ---- hostile clients: Triton inference over HTTP and gRPC ------------------------------------------
def _triton_http_cases():
    gen = f"/v2/models/{MODEL}/generate"
    return [("not JSON", gen, b"{nope", "JSON"), ("wrong type", gen, b'{"text_input": 5}', "text_input"),
            ("max_tokens absurd", gen, b'{"text_input": "hi", "max_tokens": 1000000000000}', "max_tokens"),
            ("temperature string", gen, b'{"text_input": "hi", "temperature": "hot"}', "temperature"),
            ("seed list", gen, b'{"text_input": "hi", "seed": [1, 2]}', "seed"),
            ("max_tokens object", gen, b'{"text_input": "hi", "max_tokens": {"a": 1}}', "max_tokens"),
            ("sampling_parameters deep", gen, json.dumps({"text_input": "hi", "sampling_parameters":
                                                          "[" * 5000}).encode(), "sampling_parameters"),
            ("invalid UTF-8", gen, b'{"text_input": "\xff\xfe"}', "UTF-8"),
            ("unknown model", "/v2/models/nope/generate", b'{"text_input": "hi"}', "nope"),
            ("huge body", gen, b'{"text_input": "' + b"a" * 5_000_000 + b'"}', "max-body-bytes"),
            ("deep JSON", gen, b'{"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}", "max-json-depth"),
            ("infer no inputs", f"/v2/models/{MODEL}/infer", b'{"inputs": []}', None),
            ("infer bad shape", f"/v2/models/{MODEL}/infer",
             b'{"inputs": [{"name": "text_input", "shape": [-5], "datatype": "BYTES", "data": ["hi"]}]}', None),
            ("n absurd", gen, b'{"text_input": "hi", "num_return_sequences": 1000000}', "n must be"),
            ("logit_bias absurd", gen, json.dumps({"text_input": "hi", "sampling_parameters": json.dumps(
                {"logit_bias": {str(10 ** 12): 1}})}).encode(), "logit_bias")]


def test_hostile_triton_http(server):
    wrong = []
    for name, path, body, field in _triton_http_cases():
        status, out, raw = request(server.http_url, "POST", path, body)
        TALLY.add("triton-http inference", status)
        err = error_text(out)
        if not (400 <= status < 500 or status == 503) or "Traceback" in err or (field and field not in err):
            wrong.append((name, status, raw[:300]))
    assert not wrong, "\n".join(map(str, wrong))


def test_hostile_triton_grpc(server):
    from serving_utils import raw_grpc
    cases = [("wrong dtype", {"text_input": np.array([[1.5]], dtype=np.float32)}, "text_input"),
             ("max_tokens absurd", {"text_input": "hi", "max_tokens": 2 ** 31 - 1}, "max_tokens"),
             ("temperature NaN", {"text_input": "hi", "temperature": float("nan")}, "temperature"),
             ("invalid UTF-8", {"text_input": np.array([[b"\xff\xfe"]], dtype=np.object_)}, None),
             ("unknown input", {"text_input": "hi", "bogus": 3}, "bogus"),
             ("n absurd", {"text_input": "hi", "num_return_sequences": 10 ** 6}, "n must be"),
             ("sampling_parameters junk", {"text_input": "hi", "sampling_parameters": "{" * 10000},
              "sampling_parameters")]
    wrong = []
    for name, fields, field in cases:
        outs, err = raw_grpc(server, MODEL, fields)
        TALLY.add("triton-grpc inference", "error" if err else "ok")
        if err is None or outs or "Traceback" in err or (field is not None and field not in err):
            wrong.append((name, err, len(outs)))
    assert not wrong, "\n".join(map(str, wrong))
    _, err = raw_grpc(server, "nope", {"text_input": "hi"})
    TALLY.add("triton-grpc inference", "error" if err else "ok")
    assert err and "nope" in err


# ---- hostile clients: the OpenAI API -------------------------------------------------------------
@pytest.mark.parametrize("case", openai_cases(), ids=[c[0] for c in openai_cases()])
def test_hostile_openai(openai_url, case):
    name, path, body, field = case
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, out, raw = request(openai_url, "POST", path, data)
    TALLY.add("openai", status)
    assert 400 <= status < 500 or status == 503, (name, status, raw[:300])
    err = error_text(out)
    assert "Traceback" not in err and field.lower() in err.lower(), (name, status, raw[:300])


FUZZ_VALUES = [None, -1, 0, 2 ** 63, 1e308, -1e308, "x" * 5000, "", [], {}, [[[[]]]], True, "\ud800", "\x00",
               {"1": [1] * 1000}, ["a"] * 2000, 3.5, "NaN"]
OPENAI_FIELDS = ["model", "messages", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "logprobs",
                 "top_logprobs", "logit_bias", "presence_penalty", "frequency_penalty", "stream", "stream_options",
                 "response_format", "max_completion_tokens", "tools", "user"]
TRITON_FIELDS = ["text_input", "max_tokens", "temperature", "top_k", "top_p", "stream", "stop_words", "bad_words",
                 "sampling_parameters", "num_return_sequences", "return_log_probs", "seed", "min_tokens"]
NUM_FUZZ = 150  # per surface; seeded, so every run sends the same requests


def _fuzz(url, path, base, fields, surface, seed):
    import random
    rng = random.Random(seed)
    wrong = []
    for _ in range(NUM_FUZZ):
        body, changed = dict(base), rng.sample(fields, rng.randint(1, 3))
        for f in changed:
            body[f] = rng.choice(FUZZ_VALUES)
        status, out, raw = request(url, "POST", path, json.dumps(body).encode())
        TALLY.add(surface, status)
        err = error_text(out) if status != 200 else ""
        named = any(f.lower() in err.lower() for f in changed) or "JSON" in err
        if not (status == 200 or 400 <= status < 500 or status == 503) or "Traceback" in err \
                or (status != 200 and not named):
            wrong.append((changed, status, raw[:200]))
    return wrong


def test_hostile_fuzz_openai_and_triton_http(server, openai_url):
    """Seeded random mutations of 1-3 fields: 200, or a 4xx / 503 naming one of the fields changed."""
    wrong = _fuzz(openai_url, "/v1/chat/completions", dict(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                         max_tokens=2), OPENAI_FIELDS, "openai fuzz", 1)
    wrong += _fuzz(server.http_url, f"/v2/models/{MODEL}/generate", dict(text_input="hi", max_tokens=2),
                   TRITON_FIELDS, "triton-http fuzz", 2)
    assert not wrong, "\n".join(map(str, wrong[:20]))


GRPC_ALIASES = {"num_return_sequences": "n must be"}  # the backend's sampling-parameter name


def test_hostile_fuzz_triton_grpc(server):
    """Seeded random tensors for 1-2 contract inputs (wrong dtypes, shapes, NaN, huge values) over
    gRPC streaming: a response, or an error naming one of the inputs changed."""
    import random
    from serving_utils import raw_grpc
    rng = random.Random(3)
    values = [np.array([[1.5]], dtype=np.float32), np.array([[2 ** 31 - 1]], dtype=np.int32),
              np.array([[-7]], dtype=np.int32), np.array([[float("nan")]], dtype=np.float32),
              np.array([[b"\xff" * 10]], dtype=np.object_), np.array([[b"x"] * 5], dtype=np.object_),
              np.array([[3, 4]], dtype=np.int32), np.array([[1e30]], dtype=np.float32), "x" * 3000, "", 0, 1]
    fields = ["max_tokens", "temperature", "top_k", "top_p", "seed", "stop_words", "num_return_sequences",
              "min_tokens", "stream", "sampling_parameters", "return_log_probs", "bad_words"]
    wrong = []
    for _ in range(60):
        changed = rng.sample(fields, rng.randint(1, 2))
        req = {"text_input": "hi", "max_tokens": 2}
        req.update({f: values[rng.randrange(len(values))] for f in changed})
        outs, err = raw_grpc(server, MODEL, req)
        TALLY.add("triton-grpc fuzz", "error" if err else "ok")
        names = [n for f in changed for n in (f, GRPC_ALIASES.get(f))]
        if err is not None and ("Traceback" in err or not any(n and n in err for n in names)):
            wrong.append((changed, err[:200]))
    assert not wrong, "\n".join(map(str, wrong[:20]))


def test_openai_body_over_the_limit_is_413(openai_url):
    from tritium.client.openai.openai_server import DEFAULT_MAX_BODY_BYTES
    body = b'{"model": "tiny", "prompt": "' + b"a" * (DEFAULT_MAX_BODY_BYTES + 10) + b'"}'
    status, out, _ = request(openai_url, "POST", "/v1/completions", body)
    TALLY.add("openai", status)
    assert status == 413 and "larger than" in error_text(out)


def _drop_after_first_bytes(url: str, path: str, body: dict) -> None:
    host, port = url.split("://")[-1].rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=60)
    data = json.dumps(body).encode()
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    s.recv(64)
    s.close()


def test_dropped_streams_give_their_blocks_back(server, openai_url):
    import tritonclient.grpc as grpcclient
    long = dict(max_tokens=200, min_tokens=200, temperature=0.0)
    for i in range(8):
        _drop_after_first_bytes(openai_url, "/v1/chat/completions",
                                dict(model=MODEL, messages=[{"role": "user", "content": f"drop {i}"}],
                                     stream=True, **long))
        _drop_after_first_bytes(openai_url, "/v1/completions", dict(model=MODEL, prompt=f"drop {i}", **long))
        _drop_after_first_bytes("http://" + server.http_url, f"/v2/models/{MODEL}/generate_stream",
                                dict(text_input=f"drop {i}", **long))
        TALLY.add("dropped streams", "dropped")
        TALLY.add("dropped streams", "dropped")
        TALLY.add("dropped streams", "dropped")
    for i in range(4):  # gRPC: the stream closes with its request still running
        c = grpcclient.InferenceServerClient(server.grpc_url)
        c.start_stream(callback=lambda result, error: None)
        inp = grpcclient.InferInput("text_input", [1, 1], "BYTES")
        inp.set_data_from_numpy(np.array([[b"drop"]], dtype=np.object_))
        c.async_stream_infer(MODEL, [inp])
        time.sleep(0.1)
        c.stop_stream(cancel_requests=True)
        c.close()
        TALLY.add("dropped streams", "dropped")


def test_zz_server_kept_serving_and_every_kv_block_came_back(server, openai_url):
    """Last: the figures of the suite (docs/reliability.md), printed."""
    import openai
    from tritium.client.triton_client import TritiumClient
    assert server.proc.poll() is None and server.guard_proc.poll() is None
    assert TritiumClient(server.grpc_url, model=MODEL, api_key="").generate("Hello", max_tokens=2).num_output_tokens
    oa = openai.OpenAI(base_url=openai_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    assert oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert wait_for(lambda: metric(scrape(server), "tritium_kv_cache_blocks", model=MODEL, state="used") == 0,
                    timeout=60), "KV blocks still in use after the hostile suite"
    print(f"\nhostile suite: {TALLY.total():,} requests; 5xx other than 503: {TALLY.bad() or 0}; "
          f"KV blocks in use afterwards: 0; tritonserver and guard alive\n{TALLY.table()}")
    assert not TALLY.bad()
