"""`tritium build -o DIR` never deletes a folder that is not an engine, and swaps an engine in whole."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from tritium.builder import output_dir
from tritium.client.cli.main import main


@pytest.fixture()
def ckpt(tiny_checkpoint, capsys):
    path = tiny_checkpoint("llama")
    capsys.readouterr()  # the checkpoint writer's progress output is not ours
    return path


def _build(ckpt, out, *extra):
    return main(["build", str(ckpt), "-o", str(out), "--dtype", "float32", "--quiet", *extra])


def _one_line_error(capsys, *needles):
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    for n in needles:
        assert n in err, (n, err)


def test_refuses_a_non_empty_folder_that_is_not_an_engine(ckpt, tmp_path, capsys):
    home = tmp_path / "home"
    home.mkdir()
    (home / "notes.txt").write_text("precious")
    assert _build(ckpt, home) == 2
    _one_line_error(capsys, "-o", "not empty", "not a Tritium engine")
    assert (home / "notes.txt").read_text() == "precious" and os.listdir(home) == ["notes.txt"]
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tritium-")]


def test_refuses_a_file_and_the_source_folder(ckpt, tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    assert _build(ckpt, f) == 2
    _one_line_error(capsys, "not a folder")
    src = tmp_path / "parent" / "ckpt"
    shutil.copytree(ckpt, src)
    before = sorted(os.listdir(src))
    for out in (src, src.parent):
        assert _build(src, out) == 2
        _one_line_error(capsys, "source checkpoint")
    assert sorted(os.listdir(src)) == before


def test_refuses_a_symlink(ckpt, tmp_path, capsys):
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    assert _build(ckpt, tmp_path / "link") == 2
    _one_line_error(capsys, "symbolic link")


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_replaces_an_engine_whole(ckpt, tmp_path, monkeypatch, exchange):
    if not exchange:
        monkeypatch.setattr(output_dir, "_exchange", lambda a, b: False)
    out = tmp_path / "engine"
    out.mkdir()  # an empty folder is fine
    assert _build(ckpt, out, "--max-seq-len", "64") == 0
    (out / "stale-from-old-build").write_text("x")
    assert _build(ckpt, out, "--max-seq-len", "96") == 0
    cfg = json.loads((out / "engine.json").read_text())
    assert cfg["limits"]["max_seq_len"] == 96
    assert not (out / "stale-from-old-build").exists()
    assert os.listdir(tmp_path) == ["engine"], "temporary folders left beside the engine"


def test_failed_build_leaves_the_old_engine(ckpt, tmp_path, capsys):
    out = tmp_path / "engine"
    assert _build(ckpt, out, "--max-seq-len", "64") == 0
    before = {p: (out / p).read_bytes() for p in os.listdir(out)}
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    capsys.readouterr()
    assert _build(bad, out) == 2
    assert {p: (out / p).read_bytes() for p in os.listdir(out)} == before
    assert sorted(os.listdir(tmp_path)) == ["bad", "engine"]
