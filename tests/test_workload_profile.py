"""client/bench/workload_profile.py: its argument checks and its nested op timers (the figures
themselves are a benchmark's, printed, never asserted)."""
from __future__ import annotations

import time

import pytest

from tritium.client.bench import workload_profile as wp


@pytest.mark.parametrize("flag", ["--threads", "--num-requests", "--concurrency", "--rounds"])
def test_counts_below_one_are_refused_naming_the_flag(flag, capsys):
    with pytest.raises(SystemExit) as e:
        wp.main(["/nonexistent-engine", flag, "0"])
    assert e.value.code == 2
    assert flag in capsys.readouterr().err


def test_base_kernels_must_be_a_directory(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        wp.main([str(tmp_path), "--base-kernels", str(tmp_path / "missing")])
    assert e.value.code == 2
    assert "--base-kernels" in capsys.readouterr().err


def test_base_kernels_missing_sources_are_named(tmp_path):
    with pytest.raises(SystemExit) as e:
        wp.base_lib(str(tmp_path))
    assert "cpu_decode_attention.c" in str(e.value)
    # a benchmark probe a base revision may lack is not asked for
    assert "cpu_i8dot_peak.c" not in str(e.value) and "cpu_i8dot_peak.c" in wp.OPTIONAL_SRCS


def _spin(seconds: float) -> None:
    t0 = time.process_time()
    while time.process_time() - t0 < seconds:
        pass


def test_nested_timers_count_each_second_once():
    timer = wp.OpTimer()
    inner = timer.wrap(lambda: _spin(0.05), lambda: "inner")
    outer = timer.wrap(lambda: (_spin(0.05), inner()), lambda: "outer")
    outer()
    outer()
    assert timer.calls == {"outer": 2, "inner": 2}
    # each key holds its own work only: the outer's time excludes the inner's
    assert 0.09 <= timer.secs["inner"] < 0.2
    assert 0.09 <= timer.secs["outer"] < 0.2


@pytest.mark.parametrize("n,cls", [(1, "1"), (2, "2-32"), (32, "2-32"), (33, "33-256"), (256, "33-256"),
                                   (257, ">256")])
def test_rows_classes(n, cls):
    assert wp.rows_class(n) == cls
