"""client/bench/step_claim_bench.py and step_claim_server_bench.py: their arguments, and the
background load's duty cycle (the measurements print figures and are run by hand:
docs/benchmarks.md)."""
from __future__ import annotations

import os
import time

import pytest

from tritium.client.bench import step_claim_bench, step_claim_server_bench
from tritium.client.bench.bg_load import Load


@pytest.mark.parametrize("argv,msg", [
    (["E", "--threads", "1"], "--threads must be >= 2"),
    (["E", "--batch", "0"], "--batch must be a comma list"),
    (["E", "--load-ms", "5", "--load-period-ms", "4"], "--load-ms must be in"),
    (["E", "--knob", "TRITIUM_STEP_PREFETCH=0"], "--knob must be TRITIUM_VAR=A,B"),
    (["E", "--knob", "PATH=a,b"], "--knob must be TRITIUM_VAR=A,B"),
    (["E", "--state-gbs", "0"], "--state-gbs must be > 0"),
])
def test_bad_flags_name_the_flag(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        step_claim_bench.main(argv)
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_server_bench_flags(tmp_path):
    with pytest.raises(SystemExit, match="no engine.json"):
        step_claim_server_bench.main([str(tmp_path)])
    with pytest.raises(SystemExit, match="--rounds"):
        step_claim_server_bench.main([str(tmp_path), "--rounds", "0"])


def test_load_keeps_one_core_busy_a_quarter_of_the_time():
    """1 ms of every 4 ms: the process's CPU time over 1 s of wall clock is at most about 0.25 s
    (less where other processes take its core: the duty is wall clock) and more than none; a
    whole core (a loop without its sleep) fails, measured from /proc."""
    with Load(1.0, 4.0) as ld:
        proc = ld.proc
        time.sleep(0.3)

        def cpu_s():
            with open(f"/proc/{proc.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        c0, t0 = cpu_s(), time.monotonic()
        time.sleep(1.0)
        share = (cpu_s() - c0) / (time.monotonic() - t0)
    assert 0.02 < share < 0.6, share  # CPU time: less than its wall-clock duty on a busy host


def test_pairs_split_by_the_same_second_read(capsys):
    """--state-gbs 50: a pair whose two reads are >= 50 is fast, both in [25, 50) slow, one < 25
    contended, one on each side of 50 dropped; each state's B / A is the median of its pairs' ratios."""
    modes, ld = ("A", "B"), False
    a = [(100.0, [0.01] * 10), (100.0, [0.01] * 10), (80.0, [0.02] * 10), (10.0, [0.1] * 10), (90.0, [0.01]),
         (100.0, [0.01] * 10)]
    b = [(110.0, [0.005] * 10), (130.0, [0.005] * 10), (80.0, [0.02] * 10), (30.0, [0.05] * 10), (10.0, [0.1]),
         (90.0, [0.005] * 10)]
    reads = [(60, 61), (55, 70), (30, 40), (20, 60), (40, 60), (52, 58)]
    step_claim_bench._by_state("eng", 1, {("A", ld): a, ("B", ld): b}, {ld: reads}, (ld,), modes, 50.0)
    rows = {ln.split()[3]: ln for ln in capsys.readouterr().out.splitlines()}
    assert set(rows) == {"fast", "slow", "contended"}, rows
    assert "3 pairs" in rows["fast"] and "B/A 1.100" in rows["fast"], rows["fast"]  # 1.1, 1.3, 0.9
    assert "step p10 A 10.000 B 5.000 ms, A/B 2.000" in rows["fast"], rows["fast"]
    assert "A/B 1.000" in rows["slow"] and "A/B 2.000" in rows["contended"], rows
    assert "1 pairs" in rows["slow"] and "B/A 1.000" in rows["slow"], rows["slow"]
    assert "1 pairs" in rows["contended"] and "B/A 3.000" in rows["contended"], rows["contended"]
