"""The non-toolkit parts of the llm-compressor parity script (client/tools/quant_parity.py and the
toolkit-side helpers of client/tools/quant_parity_toolkit.py that need no llmcompressor)."""
import os
import re
import types

import pytest

from tritium.builder import calibration as calib
from tritium.builder.quant.quant_pipeline import QuantOptions, _calibration_runner
from tritium.builder.quant.quantize_int4 import choose_group_size
from tritium.client.tools import quant_parity as qp
from tritium.client.tools import quant_parity_toolkit as tk

from tiny_models import train_tokenizer


def _args(tmp_path, *extra):
    text = tmp_path / "heldout.txt"
    text.write_text("held out " * 10)
    return qp.parse_args(["--llmcompressor-python", "py", "--workdir", str(tmp_path / "w"),
                          "--text", str(text), *extra])


def test_parse_args_defaults_and_schemes(tmp_path):
    a = _args(tmp_path)
    assert a.methods == ["gptq", "awq"]
    assert a.schemes == {"gptq": "W4A16", "awq": "W4A16_ASYM"}
    assert a.group_size == 128 and a.calibration_samples == 64 and a.dtype == "float32"
    a = _args(tmp_path, "--methods", "awq", "--scheme", "awq=W4A16", "--scheme", "gptq=W4A16_ASYM")
    assert a.methods == ["awq"] and a.schemes == {"gptq": "W4A16_ASYM", "awq": "W4A16"}


@pytest.mark.parametrize("extra, message", [
    (["--methods", "gptq,smoothquant"], "--methods smoothquant"),
    (["--scheme", "gptq=W8A8"], "--scheme 'gptq=W8A8'"),
    (["--scheme", "W4A16"], "--scheme 'W4A16'"),
    (["--group-size", "96"], "--group-size 96"),
    (["--calibration-samples", "0"], "--calibration-samples"),
    (["--jobs", "0"], "--jobs must be >= 1"),
    (["--text", "/nonexistent/heldout.txt"], "/nonexistent/heldout.txt: file not found"),
])
def test_parse_args_rejects_bad_values(tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit):
        _args(tmp_path, *extra)
    assert message in capsys.readouterr().err


def _res(ppl, inc, kl, top1):
    return {"perplexity": ppl, "perplexity_increase": inc, "mean_kl": kl, "top1_agreement": top1}


def test_table_orders_rows_and_formats_figures():
    rows = [qp.Row("gptq", "llm-compressor W4A16", "kjv.txt", _res(30.0, 0.25, 0.2401, 0.7)),
            qp.Row("awq", "Tritium", "kjv.txt", _res(25.0, 0.1234, 0.16, 0.81234)),
            qp.Row("gptq", "Tritium", "kjv.txt", _res(28.0, 0.2, 0.2, 0.75), "HF transformers"),
            qp.Row("rtn", "Tritium", "kjv.txt", _res(40.0, 0.44, 0.33, 0.6))]
    lines = qp.format_table(rows).splitlines()
    assert lines[0].startswith("| held-out text | method | quantized by | ppl |")
    assert len(lines) == 2 + len(rows)
    assert [ln.split("|")[2].strip() + "/" + ln.split("|")[3].strip() for ln in lines[2:]] == [
        "rtn/Tritium", "gptq/Tritium", "gptq/llm-compressor W4A16", "awq/Tritium"]
    assert lines[5] == "| kjv.txt | awq | Tritium | 25.000 | +12.34% | 0.1600 | 81.2% | tritium eval |"
    assert lines[3].endswith("| HF transformers |")


def test_verdicts_name_the_loser():
    rows = [qp.Row("gptq", "Tritium", "t", _res(1, 0.20, 0.20, 0.7)),
            qp.Row("gptq", "llm-compressor W4A16", "t", _res(1, 0.25, 0.19, 0.7)),
            qp.Row("awq", "Tritium", "t", _res(1, 0.10, 0.10, 0.8)),
            qp.Row("awq", "llm-compressor W4A16_ASYM", "t", _res(1, 0.12, 0.15, 0.8))]
    v = qp.verdicts(rows)
    assert len(v) == 2
    assert v[0].startswith("t awq: Tritium at least as good as llm-compressor W4A16_ASYM")
    assert v[1].startswith("t gptq: Tritium WORSE than llm-compressor W4A16")  # KL 0.20 > 0.19


def test_dump_calibration_gives_the_builders_windows(tmp_path):
    """Both toolkits must calibrate on the same tokens: the dumped windows are the ones the
    builder itself cuts when given the dumped file as --calibration-text."""
    tok = train_tokenizer(300)
    tok_path = str(tmp_path / "tokenizer.json")
    tok.save(tok_path)
    cal = qp.dump_calibration(tok_path, str(tmp_path / "w"), num_samples=12)
    with open(cal["text"], encoding="utf-8") as f:
        assert f.read() == calib.default_calibration_text()
    import json
    with open(cal["windows"]) as f:
        windows = json.load(f)["windows"]
    assert cal["num_windows"] == len(windows) == 12
    assert {len(w) for w in windows} == {128} and cal["seq_len"] == 128

    class Model(types.SimpleNamespace):
        pass
    cfg = types.SimpleNamespace(model=types.SimpleNamespace(num_kv_heads=1, head_dim=4, kv_lora_rank=0),
                                limits=types.SimpleNamespace(block_size=16))
    import torch
    model = Model(cfg=cfg, embed_tokens_weight=torch.zeros(300, 4))
    runner, info = _calibration_runner(model, tok, QuantOptions(calibration_text=cal["text"],
                                                                calibration_samples=12))
    builder_windows = [[int(t) for t in s] for chunk in runner.chunks for s in chunk]
    assert builder_windows == windows
    assert info["samples"] == 12 and info["seq_len"] == 128


def test_dump_calibration_of_a_given_text(tmp_path):
    tok = train_tokenizer(300)
    tok_path = str(tmp_path / "tokenizer.json")
    tok.save(tok_path)
    src = tmp_path / "cal.txt"
    src.write_text("the quick brown fox jumps over the lazy dog. " * 200, encoding="utf-8")
    cal = qp.dump_calibration(tok_path, str(tmp_path / "w"), 4, str(src))
    assert open(cal["text"], encoding="utf-8").read() == src.read_text(encoding="utf-8")
    ids = tok.encode(src.read_text(), add_special_tokens=False).ids
    import json
    assert json.load(open(cal["windows"]))["windows"] == [ids[i * 128:(i + 1) * 128] for i in range(4)]


@pytest.mark.parametrize("k", [576, 1536, 192, 96, 2048, 4864, 8960, 40])
def test_toolkit_group_plan_matches_the_builder(k):
    assert tk.layer_group_size(k, 128) == choose_group_size(k, 128)
    assert tk.layer_group_size(k, 64) == choose_group_size(k, 64)


def test_toolkit_config_groups_target_every_linear_once():
    names = {f"model.layers.{i}.{n}": k for i in range(4)
             for n, k in (("self_attn.q_proj", 576), ("self_attn.o_proj", 576), ("mlp.down_proj", 1536))}
    names["model.layers.3.mlp.gate_proj"] = 1536   # gate_proj: 128 in layer 3 ...
    names["model.layers.2.mlp.gate_proj"] = 576    # ... but 64 in layer 2: full names
    groups = tk.config_groups(tk.group_plan(names, 128), symmetric=False)
    assert set(groups) == {"group_128", "group_64"}
    for name, k in names.items():
        hits = [g for g in groups.values() for t in g["targets"] if re.match(t[3:], name)]
        assert len(hits) == 1, name
        assert hits[0]["weights"]["group_size"] == choose_group_size(k, 128)
        assert hits[0]["weights"]["symmetric"] is False
    assert "re:.*mlp\\.down_proj$" in groups["group_128"]["targets"]
    assert "re:^model\\.layers\\.3\\.mlp\\.gate_proj$" in groups["group_128"]["targets"]
    with pytest.raises(ValueError, match="in_features 40"):
        tk.group_plan({"x.layers.0.q": 40}, 128)


def test_toolkit_script_runs_without_tritium_on_the_path():
    """It is run by another environment's python: it must not import tritium."""
    src = open(tk.__file__).read()
    assert not re.search(r"^\s*(from|import)\s+tritium", src, re.M)
    assert os.path.isfile(qp.TOOLKIT_SCRIPT)


def test_cached_eval_reuses_a_result_and_stores_a_new_one(tmp_path):
    import json
    import sys
    done = tmp_path / "done.json"
    done.write_text(json.dumps({"mean_kl": 0.5}))
    log = str(tmp_path / "log")
    # a command that would fail: the stored result is used without running it
    assert qp._cached_eval(str(done), [sys.executable, "-c", "raise SystemExit(3)"], log, None) == {"mean_kl": 0.5}
    new = tmp_path / "new.json"
    cmd = [sys.executable, "-c", "print('progress'); print('{\"mean_kl\": 0.25}')"]
    assert qp._cached_eval(str(new), cmd, log, None) == {"mean_kl": 0.25}
    assert json.loads(new.read_text()) == {"mean_kl": 0.25}
    with pytest.raises(RuntimeError, match="failed"):
        qp._cached_eval(str(tmp_path / "x.json"), [sys.executable, "-c", "raise SystemExit(3)"], log, None)
    assert not (tmp_path / "x.json").exists()
