"""`tritium serve --api-key K --admin-key A --tls-cert C --tls-key K` as a user starts it, with a
self-signed certificate made in the test: the official `openai` client (TLS, key: 200; no or a
wrong key: 401), tritonclient gRPC with SSL and HTTP with SSL (inference needs the API key, the
admin APIs the admin key, and then load a model with a file override and register shared memory),
and no plain-text answer on the TLS ports. One server for the module."""
from __future__ import annotations

import json
import os
import re
import socket

import pytest

from hostile_cases import error_text, request
from serving_utils import tritium_serve
from tls_utils import self_signed

pytestmark = pytest.mark.slow
NAME = "tiny"
API_KEY = "sk-tritium-test-0123456789abcdef"
ADMIN_KEY = "admin-tritium-test-0123456789"


class Served:
    def __init__(self, proc, lines, cert):
        text = "".join(lines)
        self.proc, self.cert = proc, cert
        self.http = re.search(r"HTTP https://(\S+)", text).group(1)
        self.grpc = re.search(r"gRPC (\S+)", text).group(1)
        self.metrics_url = re.search(r"metrics (\S+)", text).group(1)
        self.base = re.search(r"OpenAI API: (\S+)", text).group(1)
        self.text = text


@pytest.fixture(scope="module")
def served(tiny_engine, tmp_path_factory):
    from tritium.builder.repository import write_repository
    root = tmp_path_factory.mktemp("tls")
    cert, key = self_signed(str(root))
    repo = str(root / "repo")
    write_repository(repo, NAME, tiny_engine("llama"))
    env = dict(os.environ, TRITIUM_CACHE=str(root / "cache"), TRITIUM_API_KEY=API_KEY)  # the key from the env
    env.pop("TRITIUM_ADMIN_KEY", None)
    with tritium_serve(repo, root, "--admin-key", ADMIN_KEY, "--tls-cert", cert, "--tls-key", key, env=env) as (proc, lines):
        yield Served(proc, lines, cert)


def test_printed_hints_name_the_key_but_never_show_it(served):
    assert served.base.startswith("https://") and served.metrics_url.startswith("https://")
    assert "Authorization: Bearer $TRITIUM_API_KEY" in served.text and "--cacert" in served.text
    assert API_KEY not in served.text and ADMIN_KEY not in served.text


def test_openai_client_over_tls_with_and_without_the_key(served):
    import ssl
    import openai

    def client(key):
        verify = ssl.create_default_context(cafile=served.cert)
        return openai.OpenAI(base_url=served.base, api_key=key, max_retries=0, timeout=120,
                             http_client=openai.DefaultHttpxClient(verify=verify))
    good = client(API_KEY)
    assert [m.id for m in good.models.list()] == [NAME]
    out = good.completions.create(model=NAME, prompt="The quick", max_tokens=3, temperature=0)
    assert out.usage.completion_tokens == 3
    omit = {"Authorization": openai.Omit()}  # the openai package then sends no Authorization header
    for c, extra, code in ((good, omit, "missing_api_key"),
                           (client("sk-wrong-wrong-wrong-wrong-wrong"), None, "invalid_api_key")):
        with pytest.raises(openai.AuthenticationError) as e:
            c.completions.create(model=NAME, prompt="The quick", max_tokens=3, extra_headers=extra)
        assert e.value.status_code == 401 and e.value.body["code"] == code
        with pytest.raises(openai.AuthenticationError):
            c.models.list(extra_headers=extra)
    status, out, _ = request(served.base.rsplit("/v1", 1)[0], "POST", "/v1/completions", b"{}", tls=True)
    assert status == 401 and out["error"]["code"] == "missing_api_key"
    status, out, _ = request(served.base.rsplit("/v1", 1)[0], "GET", "/health", tls=True)
    assert status == 200  # open: probes carry no key


def test_tritonclient_grpc_ssl(served):
    import tritonclient.grpc as grpcclient
    from tritium.client.triton_client import TritiumClient
    c = grpcclient.InferenceServerClient(served.grpc, ssl=True, root_certificates=served.cert)
    assert c.is_server_ready() and c.is_model_ready(NAME)  # health: open
    out = TritiumClient(served.grpc, model=NAME, api_key=API_KEY, tls_ca=served.cert).generate("Hi", max_tokens=3)
    assert out.num_output_tokens == 3
    for key in ("", "k" * 20):
        with pytest.raises(Exception, match="restricted"):
            TritiumClient(served.grpc, model=NAME, api_key=key, tls_ca=served.cert).generate("Hi", max_tokens=3)
    plain = grpcclient.InferenceServerClient(served.grpc)  # no TLS: no answer
    with pytest.raises(Exception):
        plain.is_server_live(client_timeout=5)


def test_tritonclient_http_ssl(served):
    import tritonclient.http as httpclient
    from tritium.client.triton_client import TritiumClient
    c = httpclient.InferenceServerClient(served.http, ssl=True, ssl_options={"ca_certs": served.cert})
    assert c.is_server_ready()
    out = TritiumClient(served.http, protocol="http", model=NAME, api_key=API_KEY,
                        tls_ca=served.cert).generate("Hi", max_tokens=3)
    assert out.num_output_tokens == 3
    status, out, _ = request(served.http, "POST", f"/v2/models/{NAME}/generate", b'{"text_input": "Hi"}', tls=True)
    assert status == 401 and "API key" in error_text(out)
    meta = c.get_model_metadata(NAME, headers={"Authorization": f"Bearer {API_KEY}"})
    assert meta["name"] == NAME
    host, port = served.http.rsplit(":", 1)  # plain HTTP on the TLS port: no answer in plain text
    s = socket.create_connection((host, int(port)), timeout=10)
    s.sendall(b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n")
    s.settimeout(10)
    try:
        data = s.recv(100)
    except OSError:
        data = b""
    s.close()
    assert not data.startswith(b"HTTP/1.1 200")


def test_admin_key_unlocks_repository_and_shared_memory_over_tls(served, tmp_path):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    import tritonclient.utils.shared_memory as shm
    from tritonclient.utils import InferenceServerException
    g = grpcclient.InferenceServerClient(served.grpc, ssl=True, root_certificates=served.cert)
    h = httpclient.InferenceServerClient(served.http, ssl=True, ssl_options={"ca_certs": served.cert})
    gh = {"triton-grpc-protocol-tritium-admin-key": ADMIN_KEY}
    hh = {"tritium-admin-key": ADMIN_KEY}
    with pytest.raises(InferenceServerException, match="restricted"):
        g.get_model_repository_index()
    with pytest.raises(InferenceServerException, match="needs the admin key"):
        h.get_model_repository_index()
    assert NAME in {m["name"] for m in h.get_model_repository_index(headers=hh)}
    marker = str(tmp_path / "ran")
    config = json.dumps({"name": "evil", "backend": "python", "max_batch_size": 0,
                         "input": [{"name": "X", "data_type": "TYPE_INT32", "dims": [1]}],
                         "output": [{"name": "Y", "data_type": "TYPE_INT32", "dims": [1]}]})
    code = (f"import pathlib\nclass TritonPythonModel:\n    def initialize(self, args):\n"
            f"        pathlib.Path({marker!r}).write_text('x')\n    def execute(self, requests):\n"
            f"        return []\n").encode()
    g.load_model("evil", config=config, files={"file:1/model.py": code}, headers=gh)
    try:
        assert os.path.exists(marker)
    finally:
        g.unload_model("evil", headers=gh)
    key = f"/tritium_tls_{os.getpid()}"
    handle = shm.create_shared_memory_region("tls", key, 64)
    try:
        h.register_system_shared_memory("tls_region", key, 64, headers=hh)
        assert "tls_region" in {r["name"] for r in h.get_system_shared_memory_status(headers=hh)}
        h.unregister_system_shared_memory("tls_region", headers=hh)
    finally:
        shm.destroy_shared_memory_region(handle)
