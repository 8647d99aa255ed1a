"""Requests that kill tritonserver 2.51's HTTP frontend, against the real server behind the guard.

Each crasher is sent to the guarded server, which must answer it with a clear error and stay
live and serving; one test sends the same bytes to an unguarded server and sees it die, so the
crashers are real and the guard is what stops them.
"""
from __future__ import annotations

import gzip
import http.client
import json
import os
import socket

import pytest

from serving_utils import wait_for

pytestmark = pytest.mark.slow
NAME = "tiny"
BIG = 6_000_000  # 2.51 crashes on a form-urlencoded body of 5 MB or more


@pytest.fixture(scope="module")
def repo(tiny_engine, tmp_path_factory):
    from tritium.builder.repository import write_repository
    path = str(tmp_path_factory.mktemp("guard") / "repo")
    write_repository(path, NAME, tiny_engine("llama"))
    return path


@pytest.fixture(scope="module")
def server(repo):
    from tritium.client.serve.server import TritonServer
    srv = TritonServer(repo, log_file=os.path.join(os.path.dirname(repo), "server.log"), load_models=[NAME])
    srv.start(timeout=240)
    yield srv
    assert srv.stop() == 0


def _post(url: str, path: str, body: bytes, headers: dict, chunked: bool = False):
    """(status, parsed JSON body or None) of one raw HTTP request."""
    host, port = url.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        if chunked:
            conn.request("POST", path, body=iter([body[:10], body[10:]]), headers=headers, encode_chunked=True)
        else:
            conn.request("POST", path, body=body, headers=headers)
        r = conn.getresponse()
        data = r.read()
        try:
            return r.status, json.loads(data)
        except ValueError:
            return r.status, data
    finally:
        conn.close()


def _generate(server, body: dict, **kw):
    return _post(server.http_url, f"/v2/models/{NAME}/generate", json.dumps(body).encode(), kw.pop("headers", {}), **kw)


def _assert_serving(server):
    assert server.proc.poll() is None, "tritonserver died"
    assert server.is_ready()
    status, out = _generate(server, {"text_input": "Hello", "max_tokens": 3, "temperature": 0.0})
    assert status == 200 and out["num_output_tokens"] == 3


FORM = {"Content-Type": "application/x-www-form-urlencoded"}


def _crashers(model: str):
    big = json.dumps({"text_input": "a" * BIG, "max_tokens": 2}).encode()
    deep = ('{"text_input":"Hello","max_tokens":2,"x":' + "[" * 200_000 + "]" * 200_000 + "}").encode()
    return [("form body 6 MB, generate", f"/v2/models/{model}/generate", big, FORM, 413, "max-body-bytes"),
            ("form body 6 MB, infer", f"/v2/models/{model}/infer", big, FORM, 413, "max-body-bytes"),
            ("JSON 200,000 deep, generate", f"/v2/models/{model}/generate", deep, {}, 400, "max-json-depth"),
            ("JSON 200,000 deep, infer", f"/v2/models/{model}/infer", deep, {}, 400, "max-json-depth")]


@pytest.mark.parametrize("case", range(4))
def test_crashers_are_refused_and_the_server_lives(server, case):
    label, path, body, headers, status, hint = _crashers(NAME)[case]
    got, out = _post(server.http_url, path, body, headers)
    assert got == status, label
    assert hint in out["error"], label
    _assert_serving(server)


def test_metrics_port_is_guarded_too(server):
    body = json.dumps({"x": "a" * BIG}).encode()
    status, _ = _post(server.metrics_url.split("//")[1].split("/")[0], "/metrics", body, FORM)
    assert status == 413
    _assert_serving(server)
    host, port = server.metrics_url.split("//")[1].split("/")[0].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("GET", "/metrics")
    assert b"tritium_kv_cache_blocks" in conn.getresponse().read()
    conn.close()


def test_hidden_crashers_chunked_gzip(server):
    """A chunked body and a small gzip body that inflate past the limits are refused."""
    big = json.dumps({"text_input": "a" * BIG, "max_tokens": 2}).encode()
    status, out = _post(server.http_url, f"/v2/models/{NAME}/generate", big, FORM, chunked=True)
    assert status == 413 and "max-body-bytes" in out["error"]
    deep = ('{"x":' + "[" * 200_000 + "]" * 200_000 + "}").encode()
    status, out = _post(server.http_url, f"/v2/models/{NAME}/generate", gzip.compress(deep),
                        {"Content-Encoding": "gzip"})
    assert status == 400 and "max-json-depth" in out["error"]
    _assert_serving(server)


def test_ordinary_requests_pass_the_guard(server):
    # curl -d / urllib: small form-urlencoded JSON is served
    status, out = _generate(server, {"text_input": "Hello", "max_tokens": 4, "temperature": 0.0}, headers=FORM)
    assert status == 200 and out["num_output_tokens"] == 4
    ref = out["output_ids"]
    # chunked, gzip and Expect: 100-continue bodies are forwarded intact
    body = json.dumps({"text_input": "Hello", "max_tokens": 4, "temperature": 0.0}).encode()
    assert _post(server.http_url, f"/v2/models/{NAME}/generate", body, {}, chunked=True)[1]["output_ids"] == ref
    assert _post(server.http_url, f"/v2/models/{NAME}/generate", gzip.compress(body),
                 {"Content-Encoding": "gzip"})[1]["output_ids"] == ref
    assert _post(server.http_url, f"/v2/models/{NAME}/generate", body,
                 {"Expect": "100-continue"})[1]["output_ids"] == ref
    # a Triton error passes through unchanged
    status, out = _generate(server, {"text_input": "Hello", "max_tokens": 0})
    assert status == 400 and "max_tokens" in out["error"]
    status, out = _post(server.http_url, f"/v2/models/{NAME}/generate", body,
                        {"Content-Type": "multipart/form-data; boundary=x"})
    assert status == 415


def test_stream_and_keep_alive_through_the_guard(server):
    host, port = server.http_url.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        ids = []
        for _ in range(2):  # two requests on one connection
            body = json.dumps({"text_input": "Hello", "max_tokens": 5, "temperature": 0.0, "stream": True})
            conn.request("POST", f"/v2/models/{NAME}/generate_stream", body=body)
            r = conn.getresponse()
            events = [json.loads(ln[5:]) for ln in r.read().decode().splitlines() if ln.startswith("data:")]
            assert r.status == 200 and len(events) >= 2
            # one id per event comes as a scalar, several as a list
            ids.append([t for e in events for t in (e["output_ids"] if isinstance(e["output_ids"], list)
                                                    else [e["output_ids"]])])
        assert ids[0] == ids[1] and len(ids[0]) == 5
    finally:
        conn.close()


def test_taken_port_fails_before_launch(repo):
    from tritium.client.serve.server import TritonServer
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        for kw, what in (("grpc_port", "gRPC"), ("http_port", "HTTP"), ("metrics_port", "metrics")):
            srv = TritonServer(repo, load_models=[NAME], **{kw: taken})
            with pytest.raises(OSError, match=f"{what} port {taken} on 127.0.0.1 is not available"):
                srv.start()
            assert srv.proc is None and srv.guard_proc is None, "a process was launched"


def test_unguarded_server_really_crashes_and_shm_is_cleaned(repo, tmp_path):
    """The same bytes kill tritonserver without the guard; its shared-memory files are removed."""
    from tritium.client.serve.launch_checks import SHM_DIR
    from tritium.client.serve.server import TritonServer
    srv = TritonServer(repo, log_file=str(tmp_path / "bare.log"), load_models=[NAME], http_guard=False)
    srv.start(timeout=240)
    try:
        mine = [f for f in os.listdir(SHM_DIR) if f.startswith(srv.shm_prefix)]
        assert mine, "the server made no shared-memory file with its prefix"
        _, path, body, headers, _, _ = _crashers(NAME)[0]
        with pytest.raises((ConnectionError, http.client.HTTPException)):
            _post(srv.http_url, path, body, headers)
        assert wait_for(lambda: srv.proc.poll() is not None, 30), "tritonserver survived the crasher"
    finally:
        srv.stop()
    assert srv.proc.returncode != 0
    assert not [f for f in os.listdir(SHM_DIR) if f.startswith(srv.shm_prefix)], "shared-memory files left"
