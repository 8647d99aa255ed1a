"""What a quantized `tritium build` shows on the console (one line per layer, then the build
report's held-out quality figures), and the thread settings that keep it fast on busy cores."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import torch

from tritium.client.cli.main import main

DIMS = dict(hidden_size=96, intermediate_size=96)


def _build(tiny_checkpoint, out, *extra):
    return main(["build", tiny_checkpoint("llama", **DIMS), "-o", str(out), "--quantization", "int4-gptq",
                 "--calibration-samples", "8", "--eval-tokens", "64", *extra])


def _quality_lines_match_the_report(err: str, engine) -> None:
    with open(os.path.join(engine, "build_report.json")) as f:
        domains = json.load(f)["quantization_report"]["eval"]["domains"]
    assert domains
    for name, d in domains.items():
        line = next((ln for ln in err.splitlines() if ln.strip().startswith(f"{name}:")), None)
        assert line is not None, (name, err)
        numbers = [float(x) for x in re.findall(r"[-+]?\d+\.\d+", line)]
        ppl, ref_ppl, incr, kl, top1 = numbers
        assert abs(ppl - d["perplexity"]) < 1e-3 and abs(ref_ppl - d["reference_perplexity"]) < 1e-3
        assert abs(incr - 100 * d["perplexity_increase"]) < 0.01
        assert abs(kl - d["mean_kl"]) < 1e-4 and abs(top1 - 100 * d["top1_agreement"]) < 0.1


def test_quantized_build_prints_each_layer_and_the_quality(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "e"
    assert _build(tiny_checkpoint, out) == 0
    err = capsys.readouterr().err
    with open(out / "engine.json") as f:
        num_layers = json.load(f)["model"]["num_layers"]
    for i in range(1, num_layers + 1):
        assert re.search(rf"quantizing \(int4-gptq\): layer {i}/{num_layers} in \d+\.\d s "
                         rf"\(elapsed \d+:\d\d, about \d+:\d\d left\)", err), (i, err)
    assert "quality vs the float model (64 held-out tokens per domain" in err
    _quality_lines_match_the_report(err, str(out))


def test_quiet_build_still_reports_its_quality(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "e"
    assert _build(tiny_checkpoint, out, "--quiet") == 0
    err = capsys.readouterr().err
    assert "quantizing" not in err
    _quality_lines_match_the_report(err, str(out))


def test_the_tritium_command_makes_openmp_threads_sleep_when_idle():
    """OMP_WAIT_POLICY must be in the environment before torch loads libgomp (which reads it once)."""
    code = ("import os, tritium.client.cli, torch; "
            "print(os.environ.get('OMP_WAIT_POLICY'), 'torch' in __import__('sys').modules)")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.stdout.split() == ["PASSIVE", "True"], r.stderr
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=dict(env, OMP_WAIT_POLICY="ACTIVE"))
    assert r.stdout.split()[0] == "ACTIVE", r.stderr  # an explicit choice is kept
    from tritium.client.serve.server import server_env
    assert os.environ.get("OMP_WAIT_POLICY", "PASSIVE") == server_env()["OMP_WAIT_POLICY"]


def test_gptq_column_loops_restore_the_thread_count():
    from tritium.builder.build_threads import SMALL_LOOP_ROWS, column_loop_threads, torch_threads
    from tritium.builder.quant.gptq import gptq_quantize
    from tritium.builder.quant.gptq_rows import gptq_int8_quantize
    before = torch.get_num_threads()
    with torch_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    assert column_loop_threads(SMALL_LOOP_ROWS) == 1
    assert column_loop_threads(SMALL_LOOP_ROWS + 1) == before
    w, x = torch.randn(64, 128), torch.randn(256, 128)
    gptq_quantize(w, 2 * x.t() @ x / 256, 32, act_order=True)
    gptq_int8_quantize(w, 2 * x.t() @ x / 256)
    assert torch.get_num_threads() == before
