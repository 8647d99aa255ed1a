"""`tritium gpu-check` on a machine without CUDA: it runs the CPU parts (placement tests, the CPU
engine half), says which parts it skipped and why, and writes its marked section into --doc,
replacing the previous one. (With a GPU the same command runs whole: docs/kernels.md#gpu-check.)"""
import pytest
import torch

from tritium.client.cli.main import main
from tritium.client.cli.gpu_check_cli import BEGIN, END, write_section


def test_write_section_replaces_only_the_marked_part(tmp_path):
    doc = tmp_path / "k.md"
    doc.write_text("# Kernels\n\nbefore\n")
    write_section(str(doc), f"{BEGIN}\none\n{END}")
    write_section(str(doc), f"{BEGIN}\ntwo\n{END}")
    text = doc.read_text()
    assert text.startswith("# Kernels\n\nbefore\n") and text.count(BEGIN) == 1 and "two" in text and "one" not in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour; with CUDA the command runs whole")
def test_gpu_check_cpu_parts(tmp_path, capsys):
    doc = tmp_path / "kernels.md"
    doc.write_text(f"# Kernels\n\n{BEGIN}\nold figures\n{END}\n\ntail\n")
    rc = main(["gpu-check", "--doc", str(doc), "--work-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "gpu-check placement: PASS" in err
    for dtype in ("float32", "bfloat16"):
        assert f"gpu-check engine {dtype}: SKIPPED: CPU half ran (3 prompts x 24 greedy tokens)" in err
    assert "gpu-check device-step: SKIPPED: CPU half ran (static buffers eagerly" in err
    for part in ("kernels", "serving", "bench"):
        assert f"gpu-check {part}: SKIPPED: no CUDA device" in err
    text = doc.read_text()
    assert "old figures" not in text and text.endswith("\n\ntail\n") and "| placement | PASS |" in text
    assert main(["gpu-check", "--skip", "gpus"]) == 2
