"""`tritium compare` pieces that run without llama.cpp: pair parsing, the ratios and the table
from suite results, the process-group CPU meter, and the flag errors (exit 2, one line)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tritium.client.cli.main import main
from tritium.client.cli.compare_cli import parse_pairs
from tritium.client.bench.compare_report import format_table, summary
from tritium.client.bench.llamacpp import ensure_llama_cpp
from tritium.client.serve.proc_cpu import group_cpu_seconds


def _run(label, tok_s, ttft=100.0):
    d = {"mean": ttft, "p50": ttft, "p90": ttft, "p99": ttft, "n": 1}
    return {"label": label, "output_tok_s": tok_s, "ttft_ms": d, "itl_ms": d, "e2e_ms": d, "errors": 0,
            "count_mismatches": 0, "client_cores": 0.01}


def _pair(llama, serve, inproc, llama_t1=None):
    """One pair's results over two repeats; each figure is (c16 tok/s, single tok/s) per repeat."""
    reps = []
    systems = (("llama-server", llama), ("tritium-serve", serve), ("in-process", inproc))
    if llama_t1 is not None:
        systems = (("llama-server-t2", llama), ("llama-server-t1", llama_t1)) + systems[1:]
    for r in range(2):
        reps.append({"workload": {"num_requests": 32},
                     "runs": {name: [_run("c16", v[r][0]), _run("single", v[r][1])] for name, v in systems}})
    return {"reps": reps, "idle_server_cores": {"llama-server": 0.0, "tritium-serve": 0.01},
            "llama_server_cmd": "-np 16", "host_load": [0.5, 2.5]}


def test_summary_ratios_and_table():
    results = {"bf16": _pair([(100, 50), (120, 70)], [(150, 40), (170, 60)], [(160, 50), (180, 50)]),
               "int8": _pair([(90, 80), (90, 80)], [(220, 60), (180, 40)], [(200, 50), (200, 50)])}
    rep = summary(results, ["bf16", "int8"])
    bf16 = rep["pairs"]["bf16"]
    assert bf16["figures"]["llama-server"]["c16"]["output_tok_s"] == 110
    assert bf16["figures"]["llama-server"]["c16"]["output_tok_s_repeats"] == [100, 120]
    assert bf16["ratios"]["tritium_vs_llama"] == {"c16": pytest.approx(160 / 110), "single": pytest.approx(50 / 60)}
    assert bf16["ratios"]["serve_vs_in_process"] == {"c16": pytest.approx(160 / 170), "single": 1.0}
    assert rep["pairs"]["int8"]["weights"] == {"llama-server": "Q8_0", "tritium": "int8 W8A8"}
    assert rep["quantized_vs_bf16"]["tritium-serve"]["int8"] == {"c16": pytest.approx(200 / 160),
                                                                 "single": pytest.approx(50 / 50)}
    assert rep["quantized_vs_bf16"]["llama-server"]["int8"]["single"] == pytest.approx(80 / 60)
    table = format_table(rep)
    assert "int8    tritium-serve     int8 W8A8" in table and "200.0" in table
    assert "tritium serve / best llama  c16 1.45x, single 0.83x" in table
    assert "tritium-serve int8 / bf16: c16 1.25x, single 1.00x" in table
    assert "bf16 0.5 -> 2.5" in table and "100.0 / 100" in table  # load; ITL p50 / p99


def test_ratios_use_the_fastest_llama_server():
    res = _pair([(100, 50), (120, 70)], [(150, 40), (170, 60)], [(160, 50), (180, 50)],
                llama_t1=[(130, 20), (130, 20)])
    rep = summary({"bf16": res}, ["bf16"])["pairs"]["bf16"]
    assert rep["best_llama"] == {"c16": "llama-server-t1", "single": "llama-server-t2"}
    assert rep["ratios"]["tritium_vs_llama"] == {"c16": pytest.approx(160 / 130), "single": pytest.approx(50 / 60)}
    table = format_table({"pairs": {"bf16": rep}})
    assert "bf16    llama-server-t1   BF16" in table and "best llama" in table


def test_parse_pairs():
    assert parse_pairs("int4,bf16") == ["int4", "bf16"]
    assert parse_pairs("int8,int8-wo,int4-wo") == ["int8", "int8-wo", "int4-wo"]
    for bad in ("", "bf16,bf16", "fp8"):
        with pytest.raises(ValueError, match="--pairs"):
            parse_pairs(bad)


def test_group_cpu_seconds_counts_a_busy_group():
    proc = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                             "while time.process_time() - t < 0.3: pass\ntime.sleep(30)"], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while group_cpu_seconds(proc.pid) < 0.25 and time.monotonic() < deadline:
            time.sleep(0.05)
        used = group_cpu_seconds(proc.pid)
        assert 0.25 <= used < 5.0
        assert group_cpu_seconds(os.getpgrp()) > 0  # this test process's group
    finally:
        proc.kill()
        proc.wait()
    assert group_cpu_seconds(proc.pid) == 0.0  # gone


def test_llama_cpp_dir_without_build_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITIUM_LLAMA_CPP_DIR", raising=False)
    with pytest.raises(ValueError, match="--llama-cpp-dir"):
        ensure_llama_cpp(str(tmp_path))
    monkeypatch.setenv("TRITIUM_LLAMA_CPP_DIR", str(tmp_path))
    with pytest.raises(ValueError, match="TRITIUM_LLAMA_CPP_DIR"):
        ensure_llama_cpp()


@pytest.mark.parametrize("argv,flag", [
    (["--pairs", "bf16,fp4"], "--pairs"), (["--repeats", "0"], "--repeats"),
    (["--llama-threads", "0"], "--llama-threads"), (["--llama-threads", "1,x"], "--llama-threads"),
    (["--concurrency", "x"], "--concurrency"), (["--gguf", "/no/such.gguf"], "--gguf"),
    (["--gguf", __file__, "--llama-cpp-dir", "/no/such/dir"], "--llama-cpp-dir")])
def test_compare_bad_flags_exit_2(capsys, argv, flag):
    rc = main(["compare", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and flag in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_pairs_compare_the_default_builds_and_weight_only_on_request(tmp_path):
    """int8 / int4 are the default builds (W8A8 / W4A8); int8-wo / int4-wo the weight-only
    engines of the same weights. A cached engine built with other activations is rebuilt; one in
    a folder the user named is refused, naming the folder and the pair."""
    import json

    from tritium.client.cli.compare_cli import ensure_engine, expected_activation_quant
    assert {k: expected_activation_quant(k) for k in ("bf16", "int8", "int4", "int8-wo", "int4-wo")} == {
        "bf16": "none", "int8": "int8", "int4": "int8", "int8-wo": "none", "int4-wo": "none"}
    for kind, mode in (("int8", "none"), ("int8-wo", "none")):
        os.makedirs(tmp_path / kind)
        (tmp_path / kind / "engine.json").write_text(json.dumps({"activation_quant": mode}))
    assert ensure_engine("int8-wo", "unused.gguf", str(tmp_path), print, cached=False) == str(tmp_path / "int8-wo")
    with pytest.raises(ValueError, match="int8 has activation_quant none, the int8 pair compares activation_quant int8"):
        ensure_engine("int8", "unused.gguf", str(tmp_path), print, cached=False)
    with pytest.raises(Exception):  # cached: the stale engine is removed and rebuilt (here: no such GGUF)
        ensure_engine("int8", str(tmp_path / "missing.gguf"), str(tmp_path), print, cached=True)
    assert not (tmp_path / "int8" / "engine.json").exists()


def test_cached_engine_is_rebuilt_when_its_build_key_changes(tmp_path, monkeypatch):
    """A cached engine is reused only while its key (the pair's options, the GGUF, the builder's
    sources) is the current one; a missing or different key rebuilds it."""
    import json

    from tritium.client.cli import compare_cli
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    engines = tmp_path / "engines"
    built = []

    def fake_build(opts):  # the builder itself is tested elsewhere; here: when it is called
        built.append(opts.source)
        os.makedirs(opts.output)
        (tmp_path / "engines" / "int8.partial" / "engine.json").write_text(json.dumps({"activation_quant": "int8"}))
    monkeypatch.setattr("tritium.builder.build.build_engine", fake_build)
    out = compare_cli.ensure_engine("int8", str(gguf), str(engines), print)
    assert built == [str(gguf)] and os.path.isfile(os.path.join(out, "engine.json"))
    key = json.loads((engines / "int8.key.json").read_text())
    assert key["builder"] == compare_cli.builder_fingerprint() and key["gguf_size"] == 4
    compare_cli.ensure_engine("int8", str(gguf), str(engines), print)
    assert len(built) == 1  # the same key: reused
    key["builder"] = "0" * 64
    (engines / "int8.key.json").write_text(json.dumps(key))
    logs = []
    compare_cli.ensure_engine("int8", str(gguf), str(engines), logs.append)
    assert len(built) == 2 and any("built with another builder" in m for m in logs)
    gguf.write_bytes(b"GGUF v2")  # another GGUF at the same path
    compare_cli.ensure_engine("int8", str(gguf), str(engines), logs.append)
    assert len(built) == 3 and "gguf_size" in logs[-2]
