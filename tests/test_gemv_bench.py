"""The streaming GEMM benchmark (client/bench/gemv_bench.py) runs on every path this host runs and
prints one row per path, kind, page placement and row count with finite rates; bad arguments are
refused."""
from __future__ import annotations

import math
import os

import pytest

from tritium.client.bench import gemv_bench
from tritium.kernels import cpu_isa


def test_gemv_bench_prints_a_row_per_path_kind_and_rows(capsys):
    paths = cpu_isa.runnable()
    assert gemv_bench.main(["--layers", "1", "--rounds", "1", "--rows", "1", "2", "--kinds", "bf16", "w4a8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [ln.split() for ln in lines[2:]]
    assert len(rows) == len(paths) * 2 * 2 * 2, lines
    assert {(r[0], r[1], r[2], r[3]) for r in rows} == {(p, k, pg, m) for p in paths for k in ("bf16", "w4a8")
                                                         for pg in ("4k", "huge") for m in ("1", "2")}
    for r in rows:
        vals = [float(v) for v in r[4:]]
        assert len(vals) == len(gemv_bench.SHAPES) + 3 and all(math.isfinite(v) and v > 0 for v in vals), r


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
    rows = [ln.split() for ln in capsys.readouterr().out.splitlines()[2:]]
    assert [r[0] for r in rows] == [path, path + "+base"], rows
    for r in rows:
        assert all(math.isfinite(float(v)) and float(v) > 0 for v in r[4:]), r
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
