"""The CLI given bad input or a bad environment: one line, exit 2, no traceback, nothing left running."""
from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading

import pytest

from tritium.backend.triton_backend.contract import resolve_path
from tritium.client.cli.main import main


def _one_line(capsys, *needles):
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    for n in needles:
        assert n in err, (n, err)
    return err


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_generate_url_with_nothing_listening(protocol, capsys):
    for _ in range(5 if protocol == "grpc" else 1):  # the gRPC failure is racy: try it a few times
        assert main(["generate", "--url", "127.0.0.1:1", "--protocol", protocol, "hi"]) == 2
        _one_line(capsys, "cannot reach tritonserver at 127.0.0.1:1", protocol)


def test_generate_url_unreachable_in_a_fresh_process():
    r = subprocess.run([sys.executable, "-m", "tritium.client.cli", "generate", "--url", "127.0.0.1:1", "hi"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.parametrize("argv,needle", [
    (["generate", "--engine", "/no/such/engine", "hi"], "/no/such/engine"),
    (["generate", "--url", "127.0.0.1:1", "--prompt-ids", "a,b"], "--prompt-ids"),
    (["serve", "--repo", "/no/such/repo"], "/no/such/repo"),
    (["serve", "--repo", ".", "--max-body-bytes", "0"], "--max-body-bytes"),
    (["serve", "--repo", ".", "--http-port", "70000"], "port"),
    (["serve", "--repo", ".", "--openai-port", "70000"], "--openai-port"),
])
def test_bad_arguments(argv, needle, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITIUM_CACHE", str(tmp_path / "cache"))
    assert main(argv) == 2
    _one_line(capsys, needle)


def test_serve_empty_repository_starts_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRITIUM_CACHE", str(tmp_path / "cache"))
    (tmp_path / "repo" / "not_a_model").mkdir(parents=True)
    assert main(["serve", "--repo", str(tmp_path / "repo"), "--openai-port", "0"]) == 2
    _one_line(capsys, "holds no model", "tritium build")
    assert not (tmp_path / "cache" / "logs").exists(), "a server was started"


class _Ready(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # answers "ready" to everything, like another server would
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *a):
        pass


@pytest.mark.slow
def test_serve_refuses_ports_held_by_another_server(tiny_engine, tmp_path, monkeypatch, capsys):
    """Another server answering /v2/health/ready on our port must not make us print "ready"."""
    from tritium.builder.repository import write_repository
    monkeypatch.setenv("TRITIUM_CACHE", str(tmp_path / "cache"))
    repo = str(tmp_path / "repo")
    write_repository(repo, "tiny", tiny_engine("llama"))
    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Ready)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    port = other.server_address[1]
    try:
        for flag, what in (("--http-port", "HTTP"), ("--grpc-port", "gRPC"), ("--metrics-port", "metrics"),
                           ("--openai-port", "OpenAI")):
            ports = {"--http-port": "0", "--grpc-port": "0", "--metrics-port": "0", "--openai-port": "0",
                     flag: str(port)}
            assert main(["serve", "--repo", repo] + [x for kv in ports.items() for x in kv]) == 2
            out = capsys.readouterr()
            assert "ready" not in out.out
            assert f"{what} port {port} on 127.0.0.1 is not available" in out.err and "Traceback" not in out.err
    finally:
        other.shutdown()
        other.server_close()


def test_engine_dir_expands_home_but_not_variables(monkeypatch, tmp_path):
    monkeypatch.setenv("SECRET_TOKEN", "hunter2")
    got = resolve_path("$SECRET_TOKEN/engine", str(tmp_path))
    assert "hunter2" not in got and got == os.path.join(str(tmp_path), "$SECRET_TOKEN", "engine")
    assert resolve_path("~/engine", str(tmp_path)) == os.path.join(os.path.expanduser("~"), "engine")
    assert resolve_path("eng", str(tmp_path)) == os.path.join(str(tmp_path), "eng")
