"""A family config value the engine cannot honour stops the build with one line naming the field
and the value (`tritium build`: exit code 2): never a silently different model. The reader is
checked in-process for every case, the CLI's exit code and single line for two of them."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file

from tritium.builder.convert import CheckpointError
from tritium.builder.hf_loader import model_config_from_hf

CLI = [sys.executable, "-m", "tritium.client.cli"]


def build(src, tmp_path):
    r = subprocess.run(CLI + ["build", str(src), "-o", str(tmp_path / "e")], capture_output=True, text=True)
    return r.returncode, r.stderr.strip()


def edited(tiny_checkpoint, tmp_path, family, edit):
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint(family), dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _set(**kv):
    return lambda cfg: cfg.update(kv)


def _rope(**kv):
    return lambda cfg: cfg["rope_parameters"].update(kv)


CASES = {
    "architecture": ("qwen3", _set(model_type="mamba"), ["model_type", "'mamba'"]),
    "rope type": ("qwen3", _rope(rope_type="ntk-by-parts"), ["rope_type", "'ntk-by-parts'"]),
    "rope factor": ("qwen3", _rope(rope_type="yarn"), ["factor", "'yarn'"]),
    "activation": ("qwen3", _set(hidden_act="relu"), ["hidden_act", "'relu'"]),
    "gemma activation": ("gemma2", _set(hidden_activation="gelu_fast"), ["hidden_activation", "'gelu_fast'"]),
    "softcap": ("gemma2", _set(final_logit_softcapping=-1), ["final_logit_softcapping", "-1"]),
    "layer type": ("gemma3", lambda c: c["layer_types"].__setitem__(0, "chunked_attention"),
                   ["layer_types", "'chunked_attention'"]),
    "longrope factors": ("phi3", _rope(short_factor=[1.0, 1.0]), ["short_factor", "6"]),
    "partial rotary": ("phi3", _rope(partial_rotary_factor=1.5), ["partial_rotary_factor", "1.5"]),
    "nope layers": ("smollm3", _set(no_rope_layers=[1, 0]), ["no_rope_layers", "2 entries"]),
    "bidirectional": ("gemma3", _set(use_bidirectional_attention=True), ["use_bidirectional_attention"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_unhonourable_config_value_is_refused_naming_it(case, tiny_checkpoint):
    family, edit, needles = CASES[case]
    cfg = json.loads(open(f"{tiny_checkpoint(family)}/config.json").read())
    edit(cfg)
    with pytest.raises(CheckpointError) as e:
        model_config_from_hf(cfg)
    msg = str(e.value)
    assert "\n" not in msg
    for n in needles:
        assert n in msg, (n, msg)


@pytest.mark.parametrize("case", ["rope type"])
def test_cli_exits_2_with_one_line(case, tiny_checkpoint, tmp_path):
    family, edit, needles = CASES[case]
    rc, err = build(edited(tiny_checkpoint, tmp_path, family, edit), tmp_path)
    assert rc == 2, (rc, err)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in lines[0], (n, lines[0])


def test_missing_qk_norm_tensor_names_it(tiny_checkpoint, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint("qwen3"), dst)
    tensors = load_file(str(dst / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    from tritium.builder.build import BuildOptions, build_engine
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.k_norm\.weight"):
        build_engine(BuildOptions(source=str(dst), output=str(tmp_path / "e"), progress=False))
