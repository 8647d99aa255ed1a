"""`tritium bench-openai`: the aiperf command it runs and the table it reads from aiperf's export
(a hand-written export in aiperf's schema; the real run is recorded in docs/openai.md)."""
from __future__ import annotations

import argparse

import pytest

from tritium.client.bench.openai_bench import aiperf_command, markdown, summarize


def _stat(avg, p50, p99):
    return {"unit": "ms", "avg": avg, "p50": p50, "p99": p99}


def test_summary_and_table_from_an_aiperf_export():
    export = {"aiperf_version": "0.13.0", "request_count": {"avg": 16}, "time_to_first_token": _stat(120.4, 110, 300),
              "inter_token_latency": _stat(20.25, 19.5, 31.0), "output_token_throughput": {"avg": 150.0},
              "request_throughput": {"avg": 2.5}, "output_token_throughput_per_user": {"avg": 45.0}}
    row = summarize(export, 4)
    assert row["ttft"] == (120.4, 110.0, 300.0) and row["itl"] == (20.25, 19.5, 31.0) and row["requests"] == 16
    table = markdown([row]).splitlines()
    assert table[0].startswith("| concurrency | requests | TTFT")
    assert table[2] == "| 4 | 16 | 120 / 110 / 300 | 20.2 / 19.5 / 31.0 | 150.0 | 2.50 | 45.0 |"
    del export["inter_token_latency"]
    with pytest.raises(ValueError, match="inter_token_latency.avg"):
        summarize(export, 4)


def test_aiperf_command_is_streaming_chat_with_fixed_lengths(monkeypatch):
    monkeypatch.delenv("TRITIUM_API_KEY", raising=False)
    args = argparse.Namespace(url="http://h:9000/v1/", model="m", tokenizer="/tok", aiperf="aiperf", warmup=1,
                              input_tokens=100, output_tokens=50)
    cmd = aiperf_command(args, 8, 32, "/out")
    joined = " ".join(cmd)
    assert cmd[:2] == ["aiperf", "profile"] and "--url http://h:9000 " in joined
    for part in ("--endpoint-type chat", "--streaming", "--concurrency 8", "--request-count 32", "--isl 100",
                 "--osl 50", "--extra-inputs ignore_eos:true", "--use-server-token-count", "--tokenizer /tok"):
        assert part in joined
    assert "--api-key" not in cmd  # no key given, none in the environment


def test_aiperf_gets_the_api_key_from_the_flag_or_the_environment(monkeypatch):
    args = argparse.Namespace(url="http://h:9000", model="m", tokenizer="/tok", aiperf="aiperf", warmup=1,
                              input_tokens=10, output_tokens=5, api_key="k" * 20)
    cmd = aiperf_command(args, 1, 8, "/out")
    assert cmd[cmd.index("--api-key") + 1] == "k" * 20
    args.api_key = None
    monkeypatch.setenv("TRITIUM_API_KEY", "e" * 20)
    cmd = aiperf_command(args, 1, 8, "/out")
    assert cmd[cmd.index("--api-key") + 1] == "e" * 20


def test_missing_aiperf_and_tokenizer_are_one_line_errors(tmp_path, capsys):
    from tritium.client.cli.main import main
    assert main(["bench-openai", "--url", "http://127.0.0.1:1", "--model", "m", "--tokenizer", str(tmp_path)]) == 2
    assert "no tokenizer.json" in capsys.readouterr().err
    (tmp_path / "tokenizer.json").write_text("{}")
    assert main(["bench-openai", "--url", "http://127.0.0.1:1", "--model", "m", "--tokenizer", str(tmp_path),
                 "--aiperf", "/no/such/aiperf"]) == 2
    assert "aiperf not found" in capsys.readouterr().err
    assert main(["bench-openai", "--url", "u", "--model", "m", "--tokenizer", str(tmp_path),
                 "--concurrency", "0"]) == 2
    assert "--concurrency" in capsys.readouterr().err
