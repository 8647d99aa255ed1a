"""A second `tritium serve` on ports that are taken: one message names every taken port, exit
code 2, nothing starts, and the running server's log is left as it was (issue 34)."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request

import pytest

from tritium.client.cli.main import main
from tritium.client.serve.launch_checks import default_log_file
from tritium.client.sockets import check_ports_free

LOG_TEXT = "I1125 08:00:00.000 server.cc:1] the first server's log\n" * 200


def _listen():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def _one_line(err: str) -> str:
    err = err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


@pytest.fixture
def repo(tmp_path):
    """A repository folder with one model entry (its engine is never loaded: nothing starts)."""
    (tmp_path / "repo" / "m" / "1").mkdir(parents=True)
    (tmp_path / "repo" / "m" / "config.pbtxt").write_text('name: "m"\nbackend: "tritium"\n')
    return str(tmp_path / "repo")


def test_two_taken_ports_are_named_in_one_message_and_the_log_is_kept(repo, tmp_path, monkeypatch, capsys):
    cache = tmp_path / "cache"
    monkeypatch.setenv("TRITIUM_CACHE", str(cache))
    http, grpc = _listen(), _listen()
    try:
        http_port, grpc_port = http.getsockname()[1], grpc.getsockname()[1]
        # the log the running server on http_port writes, and the one all servers shared before
        first_log = default_log_file(str(cache), http_port)
        with open(first_log, "w") as f:
            f.write(LOG_TEXT)
        shared_log = cache / "tritonserver.log"
        shared_log.write_text(LOG_TEXT)
        before = sorted(os.listdir(cache / "logs"))
        rc = main(["serve", "--repo", repo, "--http-port", str(http_port), "--grpc-port", str(grpc_port),
                   "--metrics-port", "0", "--openai-port", "0"])
        err = _one_line(capsys.readouterr().err)
        assert rc == 2
        assert f"HTTP port {http_port} and gRPC port {grpc_port} on 127.0.0.1 are not available" in err, err
        assert "--http-port N, --grpc-port N" in err, err
        with open(first_log) as f:
            assert f.read() == LOG_TEXT
        assert shared_log.read_text() == LOG_TEXT
        assert sorted(os.listdir(cache / "logs")) == before, "a log file was written"
    finally:
        http.close()
        grpc.close()


def test_every_taken_port_is_named(repo, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRITIUM_CACHE", str(tmp_path / "cache"))
    socks = [_listen() for _ in range(4)]
    try:
        ports = [s.getsockname()[1] for s in socks]
        rc = main(["serve", "--repo", repo] + [x for flag, p in zip(
            ("--http-port", "--grpc-port", "--metrics-port", "--openai-port"), ports) for x in (flag, str(p))])
        err = _one_line(capsys.readouterr().err)
        assert rc == 2
        for what, p in zip(("HTTP", "gRPC", "metrics", "OpenAI"), ports):
            assert f"{what} port {p}" in err, (what, err)
        assert not (tmp_path / "cache" / "logs").exists(), "a log file was written"
    finally:
        for s in socks:
            s.close()


def test_one_port_given_twice_is_a_flag_error(repo, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRITIUM_CACHE", str(tmp_path / "cache"))
    assert main(["serve", "--repo", repo, "--http-port", "18123", "--grpc-port", "18123"]) == 2
    assert "--http-port and --grpc-port are both 18123" in _one_line(capsys.readouterr().err)


def test_internal_ports_are_checked_too():
    s = _listen()
    try:
        taken = s.getsockname()[1]
        with pytest.raises(OSError) as e:
            check_ports_free("127.0.0.1", [("HTTP", 0), ("tritonserver's internal HTTP", taken)])
        msg = str(e.value)
        assert f"tritonserver's internal HTTP port {taken} on 127.0.0.1 is not available" in msg
        assert "start again" in msg
    finally:
        s.close()


@pytest.mark.slow
def test_a_failed_second_serve_leaves_the_running_server_alone(tiny_engine, tmp_path):
    """A real first server (tritium serve, default log file); a second one on its HTTP and gRPC
    ports fails in one line naming both; the first server's log only grew and it still serves."""
    from test_serving_cli import _serve, _stop
    from tritium.builder.repository import write_repository
    repo = str(tmp_path / "repo")
    write_repository(repo, "tiny", tiny_engine("llama"))
    env = dict(os.environ, TRITIUM_CACHE=str(tmp_path / "cache"))
    proc, grpc_url, http_url = _serve(["--repo", repo, "--http-port", "0", "--grpc-port", "0",
                                       "--metrics-port", "0", "--openai-port", "-1"], env)
    try:
        log = re.search(r"\(log: (\S+)\)", "".join(proc.lines)).group(1)
        http_port, grpc_port = http_url.rsplit(":", 1)[1], grpc_url.rsplit(":", 1)[1]
        assert log == default_log_file(str(tmp_path / "cache"), int(http_port))
        with open(log, "rb") as f:
            first = f.read()
        assert first, "the first server's log is empty"
        r = subprocess.run([sys.executable, "-m", "tritium.client.cli", "serve", "--repo", repo,
                            "--http-port", http_port, "--grpc-port", grpc_port, "--metrics-port", "0",
                            "--openai-port", "0"], capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 2, r.stderr
        err = _one_line(r.stderr)
        assert f"HTTP port {http_port} and gRPC port {grpc_port}" in err, err
        with open(log, "rb") as f:
            assert f.read().startswith(first), "the running server's log was truncated"
        with urllib.request.urlopen(f"http://{http_url}/v2/health/ready", timeout=30) as resp:
            assert resp.status == 200
    finally:
        _stop(proc, signal.SIGINT)


def test_picked_ports_are_distinct_even_when_the_kernel_repeats_one(tmp_path, monkeypatch):
    """The services' free ports are picked with every socket held until all are chosen, so a kernel
    that hands a closed port out again (seen: tritonserver's internal HTTP and the metrics port
    were one port in a `tritium compare` run) cannot give two services one port; a port the
    caller named is never picked for another service."""
    from tritium.client.serve import server
    picker = server.PortPicker(taken=(0, None))
    ports = [picker.pick() for _ in range(40)]
    picker.close()
    assert len(set(ports)) == 40
    # a kernel that hands the same port out again (as free_port's bind / close / bind can get):
    # the picker skips a port it already gave or that the caller named
    sequence = iter([41000, 41000, 41001, 41001, 41002, 41002, 41003, 41004, 41005, 41006])

    class Repeating:
        def __init__(self, *a):
            self.port = None

        def bind(self, addr):
            self.port = next(sequence)

        def getsockname(self):
            return ("127.0.0.1", self.port)

        def close(self):
            pass

    monkeypatch.setattr(server.socket, "socket", Repeating)
    srv = server.TritonServer(str(tmp_path), grpc_port=41002)
    picked = [srv.http_port, srv.grpc_port, srv.metrics_port, srv.triton_http_port, srv.triton_metrics_port]
    assert picked == [41000, 41002, 41001, 41003, 41004], picked
