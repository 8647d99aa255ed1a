"""The streaming GEMM benchmark (client/bench/gemv_bench.py) runs on every path this host runs and
prints one row per path, kind, page placement and row count with finite rates; bad arguments are
refused."""
from __future__ import annotations

import math
import os

import pytest

from tritium.client.bench import gemv_bench
from tritium.kernels import cpu_isa


def _tables(out: str):
    """(per-round lines, the best-of table's rows, the per-state table's rows), split on whitespace."""
    lines = out.splitlines()
    rounds = [ln.split() for ln in lines if ln.startswith("round ")]
    heads = [i for i, ln in enumerate(lines) if ln.startswith("path ")]
    assert len(heads) == 2, lines
    best = [ln.split() for ln in lines[heads[0] + 1:] if ln.strip()]
    best = best[:best.index(next(r for r in best if r[0] == "per"))] if any(r[0] == "per" for r in best) else best
    state = [ln.split() for ln in lines[heads[1] + 1:] if ln.strip()]
    return rounds, best, state


def test_gemv_bench_prints_a_row_per_path_kind_and_rows(capsys):
    paths = cpu_isa.runnable()
    assert gemv_bench.main(["--layers", "1", "--rounds", "2", "--rows", "1", "2", "--kinds", "bf16", "w4a8"]) == 0
    rounds, rows, state = _tables(capsys.readouterr().out)
    assert len(rows) == len(paths) * 2 * 2 * 2, rows
    assert {(r[0], r[1], r[2], r[3]) for r in rows} == {(p, k, pg, m) for p in paths for k in ("bf16", "w4a8")
                                                         for pg in ("4k", "huge") for m in ("1", "2")}
    for r in rows:  # per shape, all, read1, / read1, read2
        vals = [float(v) for v in r[4:]]
        assert len(vals) == len(gemv_bench.SHAPES) + 4 and all(math.isfinite(v) and v > 0 for v in vals), r
    # a line per round and kind / placement, with both reads and every path's rate at each row count
    assert len(rounds) == 2 * 2 * 2, rounds
    for r in rounds:
        assert r[5] == "read2" and float(r[6]) > 0 and r[7] == "read1" and float(r[8]) > 0, r
        assert len(r) == 10 + 2 * 2 * len(paths), r
    # per host state: each round counted in exactly one state
    assert {(r[0], r[1], r[2], r[3]) for r in state} == {(r[0], r[1], r[2], r[3]) for r in rows}
    for r in state:
        assert int(r[7]) + int(r[11]) == 2, r


def test_gemv_bench_splits_each_call_on_two_threads(capsys):
    """--threads 2: the kernels' OpenMP split (the run's team size printed); the caller's OpenMP
    thread count is restored afterwards; --threads 3 is refused."""
    import ctypes
    gomp = ctypes.CDLL("libgomp.so.1")
    before = gomp.omp_get_max_threads()
    assert gemv_bench.main(["--layers", "1", "--rounds", "1", "--rows", "1", "--kinds", "w8a8", "--pages", "huge",
                            "--threads", "2"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[[ln.startswith("round ") for ln in out.splitlines()].count(True)].startswith("threads=2")
    _, rows, _ = _tables(out)
    # rates only finite: a two-thread call of one layer's small GEMMs on a loaded host may print 0.0
    assert len(rows) == len(cpu_isa.runnable()) and all(math.isfinite(float(v)) for r in rows for v in r[4:]), rows
    assert gomp.omp_get_max_threads() == before
    with pytest.raises(SystemExit):
        gemv_bench.main(["--threads", "3"])
    assert "--threads" in capsys.readouterr().err


def test_gemv_bench_times_base_kernels_interleaved(capsys, tmp_path):
    """--base-kernels DIR: a second set of rows (path+base) from the kernels compiled out of DIR (here
    a copy of this tree's sources, so both run); a directory that is not there is refused."""
    import shutil
    from tritium.kernels import cpu_native
    for src in cpu_native._SRCS + cpu_native._HEADERS:
        shutil.copy(src, tmp_path)
    path = cpu_isa.runnable()[0]
    assert gemv_bench.main(["--layers", "1", "--rounds", "1", "--rows", "1", "--kinds", "bf16", "--pages", "4k",
                            "--paths", path, "--base-kernels", str(tmp_path)]) == 0
    _, rows, state = _tables(capsys.readouterr().out)
    assert [r[0] for r in rows] == [path, path + "+base"], rows
    for r in rows:
        assert all(math.isfinite(float(v)) and float(v) > 0 for v in r[4:]), r
    # the state table: this tree's rows, each with the median ratio to the base in its state
    assert [r[0] for r in state] == [path]
    r = state[0]
    assert math.isfinite(float(r[5] if int(r[7]) else r[9])) and float(r[5] if int(r[7]) else r[9]) > 0, r
    with pytest.raises(SystemExit):
        gemv_bench.main(["--base-kernels", str(tmp_path / "missing")])
    assert "--base-kernels" in capsys.readouterr().err


def test_gemv_bench_refuses_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        gemv_bench.main(["--layers", "0"])
    assert "--layers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gemv_bench.main(["--pages", "1g"])
    assert "--pages" in capsys.readouterr().err


@pytest.mark.parametrize("before", [None, "generic"], ids=["unset", "forced-generic"])
def test_benchmarks_forcing_paths_restore_the_callers_path(monkeypatch, capsys, before):
    """gemv_bench forces every path in turn (cpu_native.use_path); afterwards TRITIUM_CPU_ISA and
    the loaded path are the caller's again (cpu_native.paths_restored)."""
    from tritium.kernels import cpu_native
    if before is None:
        monkeypatch.delenv(cpu_isa.ENV, raising=False)
    else:
        monkeypatch.setenv(cpu_isa.ENV, before)
    cpu_native.reset()
    expected = cpu_native.isa()
    assert gemv_bench.main(["--layers", "1", "--rounds", "1", "--rows", "1", "--kinds", "bf16"]) == 0
    capsys.readouterr()
    assert os.environ.get(cpu_isa.ENV) == before
    assert cpu_native.isa() == expected
    cpu_native.reset()
