"""client/bench/tree_ab.py: two worker processes (this tree, and a base tree on PYTHONPATH; here
the same tree through a link) run one engine in interleaved rounds and the summary names both,
with the Python beside the whole-step native call measured; a folder without a tritium package
is refused naming --base."""
import math
import os

import pytest

import tritium.backend
from tritium.builder.build import BuildOptions, build_engine
from tritium.client.bench import tree_ab

pytestmark = pytest.mark.usefixtures("one_thread")


def test_two_trees_interleaved(tiny_checkpoint, tmp_path, capsys):
    engine = str(tmp_path / "engine")
    build_engine(BuildOptions(source=tiny_checkpoint("llama", hidden_size=64, intermediate_size=96,
                                                     num_attention_heads=4, num_key_value_heads=2, head_dim=32),
                              output=engine, dtype="bfloat16", progress=False))
    base = tmp_path / "base"
    base.mkdir()
    os.symlink(os.path.dirname(os.path.dirname(tritium.backend.__file__)), base / "tritium")
    assert tree_ab.main([engine, "--base", str(base), "--threads", "1", "--tokens", "3", "--pairs", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert sum(line.startswith("read ") for line in out) == 2
    assert any("this tree / base tok/s median" in line for line in out)
    rows = [line for line in out if line.strip().startswith(("base", "this tree"))]
    assert len(rows) == 2
    for row in rows:  # the Python beside the call was measured (the whole-step call ran every decode step)
        py = float(row.split("Python beside the call ")[1].split(" ms")[0])
        assert not math.isnan(py) and py > 0, row


def test_base_without_package_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        tree_ab.main(["engine", "--base", str(tmp_path)])
    assert "--base" in capsys.readouterr().err
