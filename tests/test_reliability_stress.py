"""A scaled-down run of the stress tool (client/tools/stress.py) against the real server: a few hundred
fuzzed requests over gRPC and HTTP, cancelled streams, a 10x burst. Nothing may crash, hang or
leak a KV block, and the server must still answer exactly like the in-process engine afterwards."""
from __future__ import annotations

import argparse

import pytest

pytestmark = pytest.mark.slow
NAME = "tiny"
MAX_BATCH = 8


@pytest.fixture(scope="module")
def server(tiny_engine, tmp_path_factory):
    from tritium.builder.repository import write_repository
    from tritium.client.serve.server import TritonServer
    root = tmp_path_factory.mktemp("stress")
    write_repository(str(root / "repo"), NAME, tiny_engine("llama", max_batch_size=MAX_BATCH))
    srv = TritonServer(str(root / "repo"), log_file=str(root / "server.log"), load_models=[NAME])
    srv.start(timeout=240)
    yield srv
    assert srv.stop() == 0


def test_fuzz_cancel_burst(server, tiny_engine):
    from tritium.backend.engine import LLMEngine
    from tritium.backend.sampling_params import SamplingParams
    from tritium.client.tools.stress import Target, failures, run
    from tritium.client.triton_client import TritiumClient
    args = argparse.Namespace(fuzz=300, cancels=40, burst_factor=10, max_batch=MAX_BATCH, soak_seconds=0,
                              rss_every=5.0, concurrency=8, timeout=120.0, seed=17)
    report = run(Target(server.grpc_url, server.http_url, server.metrics_url, NAME, server), args)
    assert failures(report) == [], report
    assert sum(report["fuzz"].values()) == 300
    assert report["fuzz"].get("ok", 0) > 30 and report["fuzz"].get("error", 0) > 30, report["fuzz"]
    assert report["cancel"]["kv_blocks_used_after"] == 0 and report["cancel"]["client_errors"] == 0
    assert report["burst"]["outcomes"] == {"ok": 10 * MAX_BATCH}
    assert report["burst"]["rss_after_mb"] > 0
    ref = LLMEngine(tiny_engine("llama", max_batch_size=MAX_BATCH)).generate(
        ["The quick brown fox"], SamplingParams(max_tokens=12, temperature=0.0))[0].outputs[0]
    for protocol, url in (("grpc", server.grpc_url), ("http", server.http_url)):
        got = TritiumClient(url, protocol=protocol, model=NAME).generate("The quick brown fox", max_tokens=12,
                                                                           temperature=0.0)
        assert got.token_ids == list(ref.token_ids)
