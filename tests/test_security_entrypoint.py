"""docker/entrypoint.sh run for real outside Docker (no Docker engine here): `tritonserver` on PATH
is the nvidia-pytriton wheel's binary, the bind address is loopback (TRITIUM_BIND), the ports are
free ones. With TRITIUM_API_KEY set: inference needs the key on HTTP (guard), gRPC and the OpenAI
API, and the admin APIs are refused (no TRITIUM_ADMIN_KEY). The script is the one the image runs."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from hostile_cases import error_text, request

pytestmark = pytest.mark.slow
NAME = "tiny"
KEY = "entrypoint-key-0123456789"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def container(tiny_engine, tmp_path_factory):
    from tritium.builder.repository import write_repository
    from tritium.client.serve.server import free_port, install_tritium_backend, prepare_backend_dir, wheel_paths
    root = tmp_path_factory.mktemp("entrypoint")
    repo = str(root / "repo")
    write_repository(repo, NAME, tiny_engine("llama"))
    backends = prepare_backend_dir()
    install_tritium_backend(backends)
    w = wheel_paths()
    bindir = root / "bin"
    bindir.mkdir()
    (bindir / "tritonserver").write_text(f"#!/bin/sh\nexport LD_LIBRARY_PATH={w['libs']}\nexec {w['binary']} \"$@\"\n")
    (bindir / "tritonserver").chmod(0o755)  # python3: the venv's, first on PATH (it has tritium)
    ports = {k: str(free_port()) for k in ("HTTP_PORT", "GRPC_PORT", "METRICS_PORT", "OPENAI_PORT",
                                           "TRITON_HTTP_PORT", "TRITON_METRICS_PORT")}
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRITIUM_")}
    env.update(ports, PATH=f"{bindir}:{os.path.dirname(sys.executable)}:{env['PATH']}", MODEL_REPOSITORY=repo,
               TRITIUM_BIND="127.0.0.1", TRITIUM_API_KEY=KEY)
    log = open(root / "entrypoint.log", "w")
    proc = subprocess.Popen(["sh", os.path.join(ROOT, "docker", "entrypoint.sh"), f"--backend-directory={backends}"],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    http = f"127.0.0.1:{ports['HTTP_PORT']}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert proc.poll() is None, open(root / "entrypoint.log").read()[-3000:]
        try:
            if request(http, "GET", "/v2/health/ready", timeout=2)[0] == 200:
                break
        except OSError:
            pass
        time.sleep(0.5)
    else:
        raise AssertionError("the entrypoint's server never became ready")
    yield dict(http=http, grpc=f"127.0.0.1:{ports['GRPC_PORT']}", openai=f"127.0.0.1:{ports['OPENAI_PORT']}",
               proc=proc)
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever the script's trap left behind
        except ProcessLookupError:
            pass
        log.close()


def test_entrypoint_http_needs_the_key_and_refuses_admin(container):
    body = json.dumps({"text_input": "Hi", "max_tokens": 2}).encode()
    status, out, _ = request(container["http"], "POST", f"/v2/models/{NAME}/generate", body)
    assert status == 401 and "API key" in error_text(out)
    auth = {"Authorization": f"Bearer {KEY}"}
    status, out, _ = request(container["http"], "POST", f"/v2/models/{NAME}/generate", body, auth)
    assert status == 200 and out["num_output_tokens"] == 2
    status, out, _ = request(container["http"], "POST", "/v2/repository/index", b"{}", auth)
    assert status == 403 and "disabled on this port" in error_text(out)


def test_entrypoint_grpc_and_openai(container):
    import openai
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException
    from tritium.client.triton_client import TritiumClient
    assert TritiumClient(container["grpc"], model=NAME, api_key=KEY).generate("Hi", max_tokens=2).num_output_tokens
    with pytest.raises(Exception, match="restricted"):
        TritiumClient(container["grpc"], model=NAME, api_key="").generate("Hi", max_tokens=2)
    g = grpcclient.InferenceServerClient(container["grpc"])
    with pytest.raises(InferenceServerException, match="restricted"):
        g.load_model("x", config="{}", files={"file:1/model.py": b"import os"},
                     headers={"triton-grpc-protocol-authorization": f"Bearer {KEY}"})
    base = f"http://{container['openai']}/v1"
    assert [m.id for m in openai.OpenAI(base_url=base, api_key=KEY, max_retries=0).models.list()] == [NAME]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base, api_key="wrong-key-wrong-key-1", max_retries=0).models.list()
