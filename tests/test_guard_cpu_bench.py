"""client/bench/guard_cpu_bench.py: the relay measurement runs the real Guard between a fake
upstream and a client (every event arrives), the per-thread reading of /proc, and its flags. The
served measurement needs `tritium serve` and prints figures (a benchmark, run by hand:
docs/benchmarks.md)."""
from __future__ import annotations

import os
import re
import sys
import threading
import time

import pytest

from tritium.backend.async_engine import name_os_thread
from tritium.client.bench import guard_cpu_bench

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc: Linux only")


def test_relay_mode_relays_every_event_and_prints_its_cpu(capsys):
    assert guard_cpu_bench.main(["--relay", "200"]) == 0  # raises if the client did not read all 200
    m = re.search(r"200 events: ([0-9.]+) us CPU per event", capsys.readouterr().out)
    assert m and float(m.group(1)) > 0


def test_usage_counts_a_threads_cpu_and_sleeps_under_its_name():
    stop, ready = threading.Event(), threading.Event()

    def worker():
        name_os_thread("guard-test-thr")
        end = time.thread_time() + 0.05
        while time.thread_time() < end:
            pass
        for _ in range(20):  # each sleep is a voluntary switch
            time.sleep(0.001)
        ready.set()
        stop.wait()
    t = threading.Thread(target=worker)
    before = guard_cpu_bench._usage(os.getpid()).get("guard-test-thr", [0.0, 0])
    t.start()
    try:
        assert ready.wait(10)
        cpu, switches = guard_cpu_bench._usage(os.getpid())["guard-test-thr"]
    finally:
        stop.set()
        t.join()
    assert before == [0.0, 0] and cpu >= 0.03 and switches >= 20


@pytest.mark.parametrize("argv,msg", [(["--tokens", "3"], "--tokens must be >= 16"),
                                      (["--rounds", "0"], "--rounds must be >= 1"),
                                      (["--relay", "-1"], "--relay must be >= 0")])
def test_bad_flags_name_the_flag(argv, msg, capsys):
    assert guard_cpu_bench.main(argv) == 2
    assert msg in capsys.readouterr().err


def test_no_server_on_the_port_names_url(capsys):
    assert guard_cpu_bench.main(["--url", "127.0.0.1:1", "--tokens", "16", "--rounds", "1"]) == 2
    assert "--url" in capsys.readouterr().err
