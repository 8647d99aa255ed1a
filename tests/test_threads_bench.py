"""client/bench/threads_bench.py: its arguments (the measurement itself needs tritonserver and
prints figures; it is a benchmark, run by hand: docs/benchmarks.md)."""
from __future__ import annotations

import json
import os

import pytest

from tritium.client.bench import threads_bench


def test_values_and_engines_are_parsed(tmp_path):
    assert threads_bench._int_list("1,2,auto", "--small-step-threads", auto=True) == [1, 2, "auto"]
    assert threads_bench._int_list("1,4", "--concurrency") == [1, 4]
    eng = tmp_path / "e"
    eng.mkdir()
    (eng / "engine.json").write_text(json.dumps({}))
    assert threads_bench._engines([str(eng), f"w4a8={eng}"]) == {"e": os.path.abspath(eng), "w4a8": os.path.abspath(eng)}


@pytest.mark.parametrize("argv,msg", [
    (["E", "--small-step-threads", "0"], "--small-step-threads: a comma list of integers >= 1 or auto"),
    (["E", "--small-step-threads", "two"], "--small-step-threads"),
    (["E", "--concurrency", "auto"], "--concurrency: a comma list of integers >= 1"),
    (["E", "--rounds", "0"], "--rounds"),
])
def test_bad_flags_name_the_flag(argv, msg):
    with pytest.raises(SystemExit, match=msg):
        threads_bench.main(argv)


def test_missing_engine_and_bad_label(tmp_path):
    with pytest.raises(SystemExit, match="no engine.json"):
        threads_bench.main([str(tmp_path)])
    eng = tmp_path / "e"
    eng.mkdir()
    (eng / "engine.json").write_text("{}")
    with pytest.raises(SystemExit, match="letters, digits and _ only"):
        threads_bench._engines([f"a-b={eng}"])
    with pytest.raises(SystemExit, match="each label once"):
        threads_bench._engines([f"x={eng}", f"x={eng}"])
