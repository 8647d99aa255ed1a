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


@pytest.mark.parametrize("bad", ["0", "512,x", "", "512,-1"])
def test_budgets_are_checked_and_named(tmp_path, capsys, bad):
    with pytest.raises(SystemExit) as e:
        wp.main([str(tmp_path), "--budgets", bad])
    assert e.value.code == 2
    assert "--budgets" in capsys.readouterr().err


def test_budgets_and_base_kernels_are_one_comparison_at_a_time(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        wp.main([str(tmp_path), "--budgets", "512,2048", "--base-kernels", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--budgets" in err and "--base-kernels" in err


def test_the_whole_native_step_is_counted_as_the_native_step(monkeypatch):
    """NativeStep.run_step (the step of <= 32 rows in one call, the head too with logits=True) gets a
    key of its own instead of falling into the runner's remainder."""
    import torch
    from tritium.backend.models import native_step
    for cls, name in ((wp.linear.DenseLinear, "forward"), (wp.quant._QuantLinearBase, "_cpu"),
                      (wp.decoder.DecoderLM, "compute_logits"), (wp.decoder.DecoderLM, "embed"),
                      (native_step.NativeStep, "run"), (native_step.NativeStep, "run_step"),
                      (wp.model_runner.ModelRunner, "sample"), (wp.model_runner.ModelRunner, "execute"),
                      (wp.engine_mod.LLMEngine, "step")):
        monkeypatch.setattr(cls, name, getattr(cls, name))  # restored after the test
    for name in ("paged_attention", "rms_norm", "silu_mul", "rotary_kv_write", "kv_write", "rotary"):
        monkeypatch.setattr(wp.ops, name, getattr(wp.ops, name))
    monkeypatch.setattr(native_step.NativeStep, "run_step", lambda self, model, ids, *a, logits=False: _spin(0.01))
    timer = wp.OpTimer()
    wp.install(timer)
    ns = object.__new__(native_step.NativeStep)
    ns.run_step(None, torch.zeros(16, dtype=torch.int64), None, None, None, logits=True)
    ns.run_step(None, torch.zeros(3, dtype=torch.int64), None, None, None)
    assert timer.calls == {"native decode step + LM head, rows 2-32": 1, "native decode step, rows 2-32": 1}


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


def test_load_flag_is_checked_and_named(tmp_path, capsys):
    for bad in ("1", "4/1", "x/4"):
        with pytest.raises(SystemExit) as e:
            wp.main([str(tmp_path), "--load", bad])
        assert e.value.code == 2
        assert "--load" in capsys.readouterr().err


def test_split_bench_refuses_bad_flags_naming_them(tmp_path, capsys):
    from tritium.client.bench import split_bench as sb
    for argv, flag in ((["--base-kernels", str(tmp_path / "missing")], "--base-kernels"),
                       (["--base-kernels", str(tmp_path), "--threads", "0"], "--threads"),
                       (["--base-kernels", str(tmp_path), "--rows", "0"], "--rows"),
                       (["--base-kernels", str(tmp_path), "--loads", "3/2"], "--loads")):
        with pytest.raises(SystemExit) as e:
            sb.main(argv)
        assert e.value.code == 2
        assert flag in capsys.readouterr().err


def test_load_process_is_busy_its_share_and_stops():
    """The background load works about W ms of every P ms (its CPU time over a wall interval)."""
    import os
    from tritium.client.bench.bg_load import Load

    def cpu_s(pid):  # user + system time from /proc (Linux), in clock ticks
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    with Load(2.0, 8.0) as ld:
        c0, t0 = cpu_s(ld.proc.pid), time.perf_counter()
        time.sleep(1.0)
        share = (cpu_s(ld.proc.pid) - c0) / (time.perf_counter() - t0)
    assert ld.proc.poll() is not None  # stopped
    assert 0.1 < share < 0.45, share  # 0.25 asked; a busy host stretches or delays its bursts


def test_split_bench_prints_its_figures(capsys):
    """One tiny run against this tree's own kernels as the base (the figures are printed, never
    asserted: only that every case and the totals are there)."""
    import os
    from tritium.client.bench import split_bench as sb
    from tritium.kernels import cpu_native
    here = os.path.dirname(cpu_native.__file__)
    assert sb.main(["--base-kernels", here, "--rows", "3", "--kinds", "int8", "--reps", "1", "--rounds", "1",
                    "--loads", "0/4", "1/4", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    for name in ("gate_up", "down", "qkv", "o", "LM head"):
        assert f"int8 {name:>8s}" in out
    assert out.count("the GEMMs above") == 2
