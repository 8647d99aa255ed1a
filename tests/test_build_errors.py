"""Bad checkpoints, flags and engines: one-line error naming the file/field, non-zero exit, no traceback."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

CLI = [sys.executable, "-m", "tritium.client.cli"]


def run_cli(*args):
    r = subprocess.run(CLI + list(args), capture_output=True, text=True)
    return r.returncode, r.stderr.strip()


def assert_one_line_error(rc, err, *needles):
    assert rc != 0
    assert "Traceback" not in err, err
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1, err
    for n in needles:
        assert n in lines[0], (n, lines[0])


@pytest.fixture()
def ckpt_copy(tiny_checkpoint, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint("llama"), dst)
    return dst


def test_missing_source(tmp_path):
    rc, err = run_cli("build", str(tmp_path / "nope"), "-o", str(tmp_path / "e"))
    assert_one_line_error(rc, err, "nope", "not found")


def test_truncated_safetensors(ckpt_copy, tmp_path):
    f = ckpt_copy / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    rc, err = run_cli("build", str(ckpt_copy), "-o", str(tmp_path / "e"), "--quiet")
    assert_one_line_error(rc, err, "model.safetensors")
    assert not (tmp_path / "e").exists()  # no half-written engine


def test_truncated_config_json(ckpt_copy, tmp_path):
    f = ckpt_copy / "config.json"
    f.write_text(f.read_text()[:40])
    rc, err = run_cli("build", str(ckpt_copy), "-o", str(tmp_path / "e"))
    assert_one_line_error(rc, err, "config.json", "JSON")


def test_unsupported_architecture_lists_supported(ckpt_copy, tmp_path):
    cfg = json.loads((ckpt_copy / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (ckpt_copy / "config.json").write_text(json.dumps(cfg))
    rc, err = run_cli("build", str(ckpt_copy), "-o", str(tmp_path / "e"))
    assert_one_line_error(rc, err, "gpt2", "llama", "mistral", "qwen2")


def test_dims_disagree_with_config(ckpt_copy, tmp_path):
    cfg = json.loads((ckpt_copy / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (ckpt_copy / "config.json").write_text(json.dumps(cfg))
    rc, err = run_cli("build", str(ckpt_copy), "-o", str(tmp_path / "e"), "--quiet")
    assert_one_line_error(rc, err, "mlp.gate_proj.weight", "(100, 72)", "(128, 72)")


def test_pickled_checkpoint_refused_unless_allowed(ckpt_copy, tmp_path):
    import torch
    from safetensors.torch import load_file
    sd = load_file(str(ckpt_copy / "model.safetensors"))
    os.remove(ckpt_copy / "model.safetensors")
    torch.save(sd, ckpt_copy / "pytorch_model.bin")
    rc, err = run_cli("build", str(ckpt_copy), "-o", str(tmp_path / "e"), "--quiet")
    assert_one_line_error(rc, err, "pytorch_model.bin", "--allow-pickle")
    rc, err = run_cli("build", str(ckpt_copy), "-o", str(tmp_path / "e"), "--quiet", "--allow-pickle")
    assert rc == 0, err
    assert (tmp_path / "e" / "engine.json").exists()


def test_bad_flag_value(ckpt_copy, tmp_path):
    rc, err = run_cli("build", str(ckpt_copy), "-o", str(tmp_path / "e"), "--block-size", "0")
    assert_one_line_error(rc, err, "--block-size")


def test_engine_format_from_the_future(tiny_engine, tmp_path):
    eng = tmp_path / "engine"
    shutil.copytree(tiny_engine("llama"), eng)
    cfg = json.loads((eng / "engine.json").read_text())
    cfg["format_version"] = 99
    (eng / "engine.json").write_text(json.dumps(cfg))
    rc, err = run_cli("generate", "--engine", str(eng), "--prompt-ids", "1,2,3", "--max-tokens", "2")
    assert_one_line_error(rc, err, "format_version 99", "engine.json")


def test_corrupt_engine_config_and_missing_engine(tiny_engine, tmp_path):
    rc, err = run_cli("generate", "--engine", str(tmp_path / "missing"), "--prompt-ids", "1")
    assert_one_line_error(rc, err, "missing")
    eng = tmp_path / "engine"
    shutil.copytree(tiny_engine("llama"), eng)
    (eng / "engine.json").write_text("{ not json")
    rc, err = run_cli("generate", "--engine", str(eng), "--prompt-ids", "1")
    assert_one_line_error(rc, err, "engine.json", "JSON")


def test_generate_bad_request_fields(tiny_engine):
    eng = tiny_engine("llama")
    rc, err = run_cli("generate", "--engine", eng, "--prompt-ids", "1,2", "--top-p", "2")
    assert_one_line_error(rc, err, "top_p", "(0, 1]", "2.0")
    rc, err = run_cli("generate", "--engine", eng, "--prompt-ids", "1,2", "--max-tokens", "100000")
    assert_one_line_error(rc, err, "max_tokens", "100000")
    rc, err = run_cli("generate", "--engine", eng, "--prompt-ids", "1,x")
    assert_one_line_error(rc, err, "--prompt-ids")
