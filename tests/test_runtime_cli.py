"""`tritium generate --engine` on the in-flight engine: JSONL input in order, stats, stops, n, errors."""
import json

import pytest

from tritium.backend.engine import LLMEngine
from tritium.backend.sampling_params import SamplingParams
from tritium.client.cli.main import main


# Tiny models: intra-op threads only add barrier waits (see conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


def run_cli(capsys, *argv):
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, [json.loads(line) for line in out.out.splitlines() if line.startswith("{")], out


def test_input_file_runs_together_in_order(tiny_engine, tmp_path, capsys):
    eng = tiny_engine("llama")
    lines = [{"prompt": "The quick brown fox", "max_tokens": 7},
             {"prompt_ids": [5, 6, 7, 8], "max_tokens": 3, "temperature": 0},
             {"prompt": "Paged attention", "max_tokens": 5, "stop": ["zz"]}]
    f = tmp_path / "in.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    rc, objs, _ = run_cli(capsys, "generate", "--engine", eng, "--input-file", str(f), "--stats",
                          "--ignore-eos", "--num-kv-blocks", "40", "--max-num-seqs", "4")
    assert rc == 0 and len(objs) == 4
    results, stats = objs[:3], objs[3]
    assert [len(r["token_ids"]) for r in results] == [7, 3, 5]
    assert results[1]["prompt_token_ids"] == [5, 6, 7, 8]
    for k in ("kv_blocks_used", "kv_blocks_free", "kv_blocks_cached", "preemptions"):
        assert isinstance(stats[k], int)
    assert stats["kv_blocks_total"] == 40 and stats["kv_blocks_used_peak"] > 0
    # Same tokens as each request run alone through the engine API.
    engine = LLMEngine(eng, device="cpu", num_kv_blocks=40)
    (alone,) = engine.generate(["The quick brown fox"], SamplingParams(max_tokens=7, temperature=0, ignore_eos=True))
    assert results[0]["token_ids"] == alone.outputs[0].token_ids
    assert results[0]["text"] == alone.outputs[0].text


def test_stop_logprobs_and_n(tiny_engine, capsys):
    eng = tiny_engine("llama")
    rc, (full,), _ = run_cli(capsys, "generate", "--engine", eng, "The quick brown fox", "--json",
                             "--max-tokens", "20", "--ignore-eos")
    assert rc == 0
    text = full["text"]
    start = next(i for i in range(1, len(text) - 2) if "\ufffd" not in text[i:i + 2])
    stop = text[start:start + 2]
    rc, (cut,), _ = run_cli(capsys, "generate", "--engine", eng, "The quick brown fox", "--json", "--max-tokens",
                            "20", "--ignore-eos", "--stop", "never-there", "--stop", stop, "--logprobs", "2")
    assert rc == 0
    assert cut["finish_reason"] == "stop" and cut["text"] == text[:text.index(stop)]
    assert len(cut["logprobs"]) == len(cut["token_ids"]) and len(cut["logprobs"][0]["top_logprobs"]) == 2
    rc, objs, _ = run_cli(capsys, "generate", "--engine", eng, "Hello", "--json", "--n", "3", "--temperature",
                          "1", "--seed", "1", "--max-tokens", "6")
    assert rc == 0
    assert [o["index"] for o in objs] == [0, 1, 2]
    assert len({tuple(o["token_ids"]) for o in objs}) > 1   # independent samples, not one copied


@pytest.mark.parametrize("argv,field", [
    (["--top-p", "2"], "top_p"), (["--temperature", "nan"], "temperature"), (["--max-tokens", "100000"], "max_tokens"),
    (["--n", "0"], "n"), (["--logprobs", "-3"], "logprobs")])
def test_bad_flags_exit_2_naming_the_field(tiny_engine, capsys, argv, field):
    rc, _, out = run_cli(capsys, "generate", "--engine", tiny_engine("llama"), "Hi", *argv)
    assert rc == 2 and field in out.err and "Traceback" not in out.err


def test_bad_input_file_line(tiny_engine, tmp_path, capsys):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"prompt": "ok"}\n{"prompt": "x", "temprature": 1}\n')
    rc, _, out = run_cli(capsys, "generate", "--engine", tiny_engine("llama"), "--input-file", str(f))
    assert rc == 2 and "bad.jsonl:2" in out.err and "temprature" in out.err


def test_bench_reports_consistent_figures(tiny_engine, capsys):
    """`tritium bench --hf-baselines` on a tiny engine against its own HF checkpoint: every figure is there, the
    ratios are the printed speeds' ratios, Tritium's speed is over its runs before and after the
    baselines, and both Tritium runs and HF produce the same greedy tokens (fp32)."""
    eng = tiny_engine("llama")
    rc, objs, out = run_cli(capsys, "bench", "--engine", eng, "--hf-baselines", "--num-requests", "6", "--prompt-len", "4", "12",
                            "--output-len", "2", "6", "--hf-batch-size", "3", "--device", "cpu", "--json")
    assert rc == 0
    res = objs[-1]
    s1, s2 = res["tritium_seconds_runs"]
    assert res["tritium_tok_s"] == pytest.approx(2 * res["output_tokens"] / (s1 + s2))
    assert res["speedup_vs_hf_static"] == pytest.approx(res["tritium_tok_s"] / res["hf_static_tok_s"])
    assert res["speedup_vs_hf_sequential"] == pytest.approx(res["tritium_tok_s"] / res["hf_sequential_tok_s"])
    assert 0 < res["kv_live_fraction"] <= 1 and res["preemptions"] == 0
    assert "outputs identical" in out.out
    assert "greedy outputs identical to Tritium for 6/6" in out.out
