"""`tritium generate --speculative ...` and `tritium build --repo ... --speculative ...`: the flags
reach the engine (same greedy tokens as without, counters in --stats) or the model config, and
bad combinations end with one line naming the flag (exit 2)."""
import json

import pytest

from tritium.client.cli.main import main

pytestmark = pytest.mark.usefixtures("one_thread")


def run_cli(capsys, *argv):
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, [json.loads(line) for line in out.out.splitlines() if line.startswith("{")], out


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_generate_speculative_equals_plain_and_reports_counters(tiny_engine, capsys, method):
    eng = tiny_engine("qwen2")
    args = ["generate", "--engine", eng, "--prompt-ids", "5,6,7,5,6,7,5,6", "--max-tokens", "40",
            "--ignore-eos", "--json", "--stats", "--device", "cpu"]
    rc, (plain, _), _ = run_cli(capsys, *args)
    extra = ["--draft-engine", tiny_engine("qwen2", dtype="bfloat16")] if method == "draft" else []
    rc2, (fast, stats), _ = run_cli(capsys, *args, "--speculative", method, "--num-speculative-tokens", "3", *extra)
    assert rc == rc2 == 0
    assert fast["token_ids"] == plain["token_ids"]
    assert stats["spec_method"] == method and stats["spec_accepted_tokens"] > 0
    assert stats["spec_proposed_tokens"] >= stats["spec_accepted_tokens"]
    assert stats["num_steps"] < 40  # fewer steps than tokens: some steps emitted several


@pytest.mark.parametrize("argv, message", [
    (["--draft-engine", "x"], "--draft-engine / --num-speculative-tokens (parameters draft_engine_dir / "
                              "num_speculative_tokens) need --speculative"),
    (["--speculative", "ngram", "--num-speculative-tokens", "0"], "--num-speculative-tokens must be an integer in [1, 16]"),
    (["--speculative", "draft"], "needs draft_engine_dir"),
])
def test_generate_bad_speculative_flags(tiny_engine, capsys, argv, message):
    rc = main(["generate", "--engine", tiny_engine("llama"), "--prompt-ids", "5,6", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err


def test_build_writes_speculative_parameters_and_checks_them(tiny_checkpoint, tiny_engine, tmp_path, capsys):
    draft = tiny_engine("llama", dtype="bfloat16")
    repo = tmp_path / "repo"
    rc = main(["build", tiny_checkpoint("llama"), "-o", str(tmp_path / "e"), "--dtype", "float32", "--quiet",
               "--repo", str(repo), "--name", "m", "--speculative", "draft", "--draft-engine", draft,
               "--num-speculative-tokens", "6"])
    assert rc == 0
    text = (repo / "m" / "config.pbtxt").read_text()
    assert 'key: "speculative_method" value { string_value: "draft" }' in text
    assert f'key: "draft_engine_dir" value {{ string_value: "{draft}" }}' in text
    assert 'key: "num_speculative_tokens" value { string_value: "6" }' in text
    for argv, message in ((["--speculative", "ngram"], "needs --repo"),
                          (["--repo", str(tmp_path / "r2"), "--speculative", "draft", "--draft-engine",
                            str(tmp_path / "nowhere")], "no engine.json there")):
        rc = main(["build", tiny_checkpoint("llama"), "-o", str(tmp_path / "e2"), "--quiet", *argv])
        err = capsys.readouterr().err
        assert rc == 2 and message in err, err
        assert not (tmp_path / "e2").exists()  # checked before building
