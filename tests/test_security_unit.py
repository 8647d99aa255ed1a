"""The security pieces without a server: keys and their comparison, tritonserver's restricted-API
flags, the HTTP guard's route -> API table and key checks, the OpenAI API's key middleware, and
the refusal of an open non-loopback bind by `tritium serve`, `tritium openai` and the Docker
entrypoint (one line, exit 2, nothing started)."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess

import pytest

from tritium.client.serve.guard_auth import GuardKeys, api_of, check_access
from tritium.client.serve.http_checks import GuardError, check_json_syntax, upstream_status
from tritium.client.security import (ADMIN_APIS, KEYED_APIS, Security, bearer_token, check_exposure, check_key,
                                     is_loopback, keys_match)

KEY = "k" * 24
ADMIN = "a" * 24
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_keys():
    assert check_key(None, "--api-key") is None and check_key("", "--api-key") is None
    assert check_key("sk-" + "A1._~+/" * 3 + "==", "--api-key")
    for bad, why in (("short", "at least 16"), ("has space " * 3, "only letters"), ("a:b,c=d" * 4, "only letters"),
                     ("é" * 20, "only letters")):
        with pytest.raises(ValueError, match=why):
            check_key(bad, "--api-key")
    assert keys_match(KEY, KEY) and not keys_match(KEY[:-1] + "x", KEY) and not keys_match(None, KEY)
    assert not keys_match("\udcff" * 3, KEY)  # a header that is not UTF-8 never raises
    assert bearer_token("Bearer abc") == "abc" and bearer_token("bearer  abc ") == "abc"
    assert bearer_token("Basic abc") is None and bearer_token("Bearer ") is None and bearer_token(None) is None


def test_loopback_and_exposure():
    assert is_loopback("127.0.0.1") and is_loopback("127.1.2.3") and is_loopback("::1") and is_loopback("localhost")
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.1", "example.com", "[::]"))
    check_exposure("127.0.0.1", Security(), False, "x")
    check_exposure("0.0.0.0", Security(api_key=KEY), False, "x")
    check_exposure("0.0.0.0", Security(), True, "x")
    with pytest.raises(ValueError, match="--api-key KEY or \\$TRITIUM_API_KEY.*--insecure"):
        check_exposure("0.0.0.0", Security(), False, "inference on port 8000")


def test_triton_args_and_headers():
    default = Security()
    args = default.triton_args()
    admin = ",".join(ADMIN_APIS)
    assert args == [f"--http-restricted-api={admin}:tritium-admin-key={default.internal_admin_key}",
                    f"--grpc-restricted-protocol={admin}:tritium-admin-key={default.internal_admin_key}"]
    assert len(default.internal_admin_key) >= 32 and default.internal_admin_key != Security().internal_admin_key
    sec = Security(api_key=KEY, admin_key=ADMIN, tls_cert="c.pem", tls_key="k.pem")
    args = sec.triton_args()
    assert f"--grpc-restricted-protocol={','.join(KEYED_APIS)}:authorization=Bearer {KEY}" in args
    assert f"--http-restricted-api={admin}:tritium-admin-key={ADMIN}" in args
    assert args[-3:] == ["--grpc-use-ssl=true", "--grpc-server-cert=c.pem", "--grpc-server-key=k.pem"]
    assert sec.headers("grpc") == {"triton-grpc-protocol-authorization": f"Bearer {KEY}"}
    assert sec.headers("http", admin=True) == {"authorization": f"Bearer {KEY}", "tritium-admin-key": ADMIN}
    assert KEY not in repr(sec) and ADMIN not in repr(sec) and default.internal_admin_key not in repr(default)
    with pytest.raises(ValueError, match="go together"):
        Security(tls_cert="c.pem")


ROUTES = [("/v2/health/ready", "health"), ("/v2/health/live", "health"), ("/v2/models/m/ready", "health"),
          ("/v2/models/m/versions/3/ready", "health"), ("/v2", "metadata"), ("/v2/models/m", "metadata"),
          ("/v2/models/m/infer", "inference"), ("/v2/models/m/versions/1/infer", "inference"),
          ("/v2/models/m/generate?x=1", "inference"), ("/v2/models/m/generate_stream", "inference"),
          ("/v2/models/stats", "statistics"), ("/v2/models/m/stats", "statistics"),
          ("/v2/models/m/config", "model-config"), ("/v2/models/m/versions/2/config", "model-config"),
          ("/v2/repository/index", "model-repository"), ("/v2/repository/models/m/load", "model-repository"),
          ("/v2/repository//index", "model-repository"), ("/v2/repository", "model-repository"),
          ("/v2/systemsharedmemory/region/r/register", "shared-memory"),
          ("/v2/cudasharedmemory/status", "shared-memory"), ("/v2/trace/setting", "trace"),
          ("/v2/models/m/trace/setting", "trace"), ("/v2/logging", "logging"),
          ("//v2/repository/index", None), ("/v2/%72epository/index", None), ("/V2/repository/index", None),
          ("/v2/models/m/../config", None), ("/v2/models/m/versions/x/infer", None), ("/", None), ("/metrics", None),
          ("/v2/repositoryx/index", None)]


@pytest.mark.parametrize("target,api", ROUTES)
def test_route_to_api(target, api):
    assert api_of(target) == api


def _status(target, headers, keys):
    try:
        check_access(target, lambda n: headers.get(n), keys)
        return 200
    except GuardError as e:
        return e.status, e.message, dict(e.headers)


def test_guard_key_checks():
    default = GuardKeys(admin_key=ADMIN, admin_configured=False)
    keyed = GuardKeys(admin_key=ADMIN, admin_configured=True, api_key=KEY)
    assert _status("/v2/models/m/generate", {}, default) == 200  # no API key configured: inference open
    st, msg, _ = _status("/v2/repository/models/m/load", {}, default)
    assert st == 403 and "disabled on this port" in msg and "--admin-key" in msg
    st, msg, _ = _status("/v2/repository/index", {"tritium-admin-key": "x" * 24}, keyed)
    assert st == 403 and "needs the admin key" in msg
    assert _status("/v2/repository/index", {"tritium-admin-key": ADMIN}, default) == 200
    assert _status("/v2/systemsharedmemory/status", {"tritium-admin-key": ADMIN}, keyed) == 200
    st, msg, hdrs = _status("/v2/models/m/infer", {}, keyed)
    assert st == 401 and "no API key" in msg and hdrs["WWW-Authenticate"].startswith("Bearer")
    st, msg, _ = _status("/v2/models/m", {"authorization": "Bearer " + "z" * 24}, keyed)
    assert st == 401 and "a wrong API key" in msg
    assert _status("/v2/models/m/generate", {"authorization": f"Bearer {KEY}"}, keyed) == 200
    assert _status("/v2/health/ready", {}, keyed) == 200  # probes stay open
    assert _status("/nope", {"tritium-admin-key": ADMIN}, keyed)[0] == 404
    assert GuardKeys.from_env({}) is None
    assert GuardKeys.from_env({"TRITIUM_GUARD_ADMIN_KEY": ADMIN, "TRITIUM_GUARD_API_KEY": KEY}) == \
        GuardKeys(admin_key=ADMIN, admin_configured=False, api_key=KEY)


def test_client_mistakes_tritonserver_calls_5xx():
    assert upstream_status(500, b'{"error":"Unable to parse \'data\': attempt to access JSON non-number"}') == 400
    assert upstream_status(501, b'{"error":"HTTP end point doesn\'t support models with decoupled '
                                b'transaction policy"}') == 400
    assert upstream_status(500, b'{"error":"Stub process is not healthy."}') == 500
    assert upstream_status(200, b'{"error":"Unable to parse"}') == 200
    check_json_syntax(b"")
    check_json_syntax(b'{"a": [1, 2]}')
    for bad, why in ((b"{nope", "not valid JSON"), (b'{"a": "\xff"}', "not UTF-8")):
        with pytest.raises(GuardError, match=why) as e:
            check_json_syntax(bad)
        assert e.value.status == 400


def _asgi(app, path, headers=()):
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(msg):
        sent.append(msg)
    scope = {"type": "http", "path": path, "method": "GET", "headers": list(headers)}
    asyncio.run(app(scope, receive, send))
    return sent


def test_openai_key_middleware():
    from tritium.client.openai.openai_auth import RequireApiKey
    reached = []

    async def app(scope, receive, send):
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
    guarded = RequireApiKey(app, KEY)
    sent = _asgi(guarded, "/v1/models")
    assert sent[0]["status"] == 401 and not reached
    assert json.loads(sent[1]["body"])["error"]["code"] == "missing_api_key"
    assert (b"www-authenticate", b'Bearer realm="tritium"') in sent[0]["headers"]
    sent = _asgi(guarded, "/v1/chat/completions", [(b"authorization", b"Bearer " + b"x" * 24)])
    assert sent[0]["status"] == 401 and json.loads(sent[1]["body"])["error"]["code"] == "invalid_api_key"
    assert _asgi(guarded, "/v1/models", [(b"authorization", f"Bearer {KEY}".encode())])[0]["status"] == 200
    assert _asgi(guarded, "/health")[0]["status"] == 200
    assert _asgi(guarded, "/v1/../health")[0]["status"] == 401  # only the exact open path
    assert reached == ["/v1/models", "/health"]


@pytest.mark.parametrize("cmd", [["serve", "--repo", "/nonexistent"], ["openai", "--triton-url", "127.0.0.1:1"]])
def test_open_non_loopback_bind_exits_2(cmd, capsys, monkeypatch):
    from tritium.client.cli.main import main
    monkeypatch.delenv("TRITIUM_API_KEY", raising=False)
    assert main([*cmd, "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--host 0.0.0.0 would expose" in err[0] and "--api-key" in err[0] \
        and "--insecure" in err[0]
    if cmd[0] == "serve":  # the line says what is exposed; --insecure or a key gets past this check
        assert "8000 (HTTP), 8001 (gRPC), 9000 (OpenAI API)" in err[0]
        assert main([*cmd, "--host", "0.0.0.0", "--insecure"]) == 2
        assert "not a folder" in capsys.readouterr().err
        monkeypatch.setenv("TRITIUM_API_KEY", KEY)
        assert main([*cmd, "--host", "0.0.0.0"]) == 2
        assert "not a folder" in capsys.readouterr().err


def test_docker_entrypoint_refuses_to_start_open(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRITIUM_")}
    env["PATH"] = f"{tmp_path}:{env['PATH']}"
    (tmp_path / "tritonserver").write_text("#!/bin/sh\necho started > " + str(tmp_path / "started") + "\n")
    (tmp_path / "tritonserver").chmod(0o755)
    r = subprocess.run(["sh", os.path.join(ROOT, "docker", "entrypoint.sh")], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "TRITIUM_API_KEY" in r.stderr and "TRITIUM_INSECURE=1" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "started").exists()
    r = subprocess.run(["sh", os.path.join(ROOT, "docker", "entrypoint.sh")], env=dict(env, TRITIUM_API_KEY="short"),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "at least 16" in r.stderr and not (tmp_path / "started").exists()


def test_generate_body_types_follow_the_tensor_contract():
    from tritium.client.serve.generate_checks import check_generate_fields, is_generate
    assert is_generate("/v2/models/m/generate") and is_generate("/v2/models/m/versions/2/generate_stream?x=1")
    assert not is_generate("/v2/models/m/infer") and not is_generate("/v2/models/m/generate/x")
    check_generate_fields({"text_input": "hi", "max_tokens": [3], "stop_words": ["a", "b"], "stop_words_x": 5,
                           "temperature": 0.5, "stream": True, "seed": 2 ** 63, "input_ids": [1, 2], "bad_words": []})
    for body, field, why in (({"text_input": 5}, "text_input", "a string"), ({"seed": -1}, "seed", "[0, 2^64 - 1]"),
                             ({"max_tokens": 2 ** 31}, "max_tokens", "an integer"),
                             ({"max_tokens": True}, "max_tokens", "an integer"),
                             ({"temperature": "hot"}, "temperature", "a finite number"),
                             ({"stream": 1}, "stream", "true or false"), ({"top_k": [1, 2]}, "top_k", "a list of 2"),
                             ({"stop_words": [["a"]]}, "stop_words", "a string or a list"),
                             ({"sampling_parameters": {"n": 2}}, "sampling_parameters", "an object")):
        with pytest.raises(GuardError) as e:
            check_generate_fields(body)
        assert e.value.status == 400 and e.value.message.startswith(field) and why in e.value.message
    with pytest.raises(GuardError, match="JSON object"):
        check_generate_fields([1, 2])
