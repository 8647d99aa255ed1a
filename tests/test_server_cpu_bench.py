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


@pytest.mark.parametrize("argv,msg", [
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
