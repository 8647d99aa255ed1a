"""client/bench/server_cpu_bench.py: its arguments, and that it files each thread's CPU under the
name the backend gives the thread (backend/async_engine.name_os_thread), read back from /proc. The
measurement itself needs tritonserver and prints figures (a benchmark, run by hand:
docs/benchmarks.md)."""
from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from tritium.backend.async_engine import name_os_thread
from tritium.client.bench import server_cpu_bench

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc: Linux only")


def _burn(name: str, seconds: float, burned: threading.Event, stop: threading.Event) -> None:
    name_os_thread(name)
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass
    burned.set()
    stop.wait()  # alive (so listed in /proc) until the test has read its CPU


def test_thread_names_reach_the_os_and_the_roles():
    burned, stop = threading.Event(), threading.Event()
    t = threading.Thread(target=_burn, args=("tritium-deliver-and-more", 0.3, burned, stop))
    t.start()
    try:
        assert burned.wait(60)
        with open(f"/proc/{os.getpid()}/task/{t.native_id}/comm") as f:
            assert f.read().strip() == "tritium-deliver"  # the first 15 bytes
        cpu = server_cpu_bench.thread_cpu({"stub": os.getpid(), "server": os.getpid()})
    finally:
        stop.set()
        t.join()
    assert set(cpu) == set(server_cpu_bench.ROLES)
    assert cpu["tritium-deliver"] >= 0.2, cpu  # the burning thread, filed under its name (10 ms ticks)
    assert cpu["tritium-loop"] == 0.0 and cpu["tritium-stats"] == 0.0


def test_loop_thread_and_its_workers_are_told_apart():
    """The first thread named tritium-loop is the engine loop; later ones (OpenMP's workers, which
    inherit the name) are filed as loop workers, in the stub and in this process alike."""
    burned = [threading.Event(), threading.Event()]
    stop = threading.Event()
    loop = threading.Thread(target=_burn, args=("tritium-loop", 0.1, burned[0], stop))
    loop.start()
    assert burned[0].wait(60)
    worker = threading.Thread(target=_burn, args=("tritium-loop", 0.3, burned[1], stop))
    worker.start()
    try:
        assert burned[1].wait(60)
        cpu = server_cpu_bench.thread_cpu({"stub": os.getpid(), "server": os.getpid()})
        own = server_cpu_bench._own_cpu()
    finally:
        stop.set()
        loop.join()
        worker.join()
    assert 0.05 <= cpu["tritium-loop"] < 0.25, cpu
    assert cpu["loop workers"] >= 0.25, cpu
    assert 0.05 <= own["tritium-loop"] < 0.25 and own["loop workers"] >= 0.25, own
    assert own["process"] >= own["tritium-loop"] + own["loop workers"]


@pytest.mark.parametrize("argv,msg", [
    (["--concurrency", "-1"], "--concurrency must be >= 1"),
    (["--engine", "/nonexistent"], "--engine needs it"),
    (["--concurrency", "16", "--engine", "/nonexistent"], "--engine /nonexistent: no engine.json there"),
    (["--tokens", "3"], "--tokens must be >= 16"),
    (["--rounds", "0"], "--rounds must be >= 1"),
    (["--url", "localhost"], "--url must be HOST:PORT"),
])
def test_bad_flags_name_the_flag(argv, msg, capsys):
    assert server_cpu_bench.main(argv) == 2
    assert msg in capsys.readouterr().err


def test_no_server_on_the_port_names_url(capsys):
    assert server_cpu_bench.main(["--url", "127.0.0.1:1", "--rounds", "1"]) == 2
    assert "--url: no tritonserver with --grpc-port=1" in capsys.readouterr().err


def test_workload_mode_without_a_server_names_url(capsys):
    assert server_cpu_bench.main(["--url", "127.0.0.1:1", "--concurrency", "16"]) == 2
    assert "--url: no tritonserver with --grpc-port=1" in capsys.readouterr().err


def test_workload_rows_print_every_role(capsys):
    ms = {r: 0.1 * (i + 1) for i, r in enumerate(server_cpu_bench.ROLES)}
    ms["overhead"] = sum(ms[r] for r in server_cpu_bench.OVERHEAD)
    row = {"round": 0, "system": "server", "tok_s": 100.0, "tokens": 4000, "tokens_per_response": 1.25,
           "tok_per_cpu_s": 1000 / sum(ms[r] for r in server_cpu_bench.ROLES), "ms_per_token": ms}
    server_cpu_bench._print_workload({"model": "m", "url": "u:1", "concurrency": 16, "rounds": [row]})
    head, line = capsys.readouterr().out.strip().splitlines()[1:3]
    assert all(r in head for r in server_cpu_bench.ROLES) and "tok/resp" in head
    assert line.split()[:5] == ["0", "server", "100.0", f"{row['tok_per_cpu_s']:.1f}", "1.25"]
