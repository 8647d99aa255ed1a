"""Tensor parallelism through a real tritonserver (nvidia-pytriton wheel) on loopback ports.

One server for the module, fp32 engines at TP = 1 and TP = 2 of the tiny Llama and of SmolLM2;
the TP = 2 tiny model runs two instances (instance_group count 2). Checked through tritonclient
only: same greedy tokens and per-token logprobs (the logits' log-softmax) within 1e-4; both
instances serve; a killed worker fails its model's requests with a clear error and flips the
model's tritium_engine_healthy gauge to 0; unloading a model stops its workers; and after the
server stops no worker is left.
"""
from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from serving_utils import metric, scrape, wait_for
from tp_utils import TEST_TIMEOUT_S, processes_with, tp_timeout, wait_no_workers  # noqa: F401 (fixture)

pytestmark = pytest.mark.slow

PROMPTS = ["Hello world, this is a test", "The quick brown fox", "naïve café — 日本語"]
SMOL_PROMPTS = ["<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n",
                "The capital of France is"]


@pytest.fixture(scope="module")
def engines(tiny_engine, smollm2_engine):
    return {"tiny1": tiny_engine("llama", "float32"), "tiny2": tiny_engine("llama", "float32", tensor_parallel_size=2),
            "smol1": smollm2_engine("float32"), "smol2": smollm2_engine("float32", tensor_parallel_size=2)}


@pytest.fixture(scope="module")
def server(engines, tmp_path_factory, tp_timeout):
    from tritium.builder.repository import write_repository
    from tritium.client.serve.server import TritonServer
    root = tmp_path_factory.mktemp("serving-tp")
    repo = str(root / "repo")
    for name, path in engines.items():
        params = {"num_kv_blocks": "256", "num_threads": "1", "small_step_threads": "1"}
        if name.endswith("2"):
            params["threads_per_rank"] = "1"
        write_repository(repo, name, path, engine_params=params, instances=2 if name == "tiny2" else 1)
    srv = TritonServer(repo, log_file=str(root / "server.log"), load_models=list(engines))
    srv.start(timeout=300)
    try:
        yield srv
    finally:
        srv.stop()
        left = [pid for path in engines.values() for pid in wait_no_workers(path)]
        for pid in left:  # never leave one behind, even when the assertion below fails
            os.kill(pid, signal.SIGKILL)
        assert not left, f"tensor-parallel workers outlived the server: {left}"


def client(server, model):
    from tritium.client.triton_client import TritiumClient
    return TritiumClient(server.grpc_url, protocol="grpc", model=model, timeout=300)


@pytest.mark.parametrize("pair,prompts", [(("tiny1", "tiny2"), PROMPTS), (("smol1", "smol2"), SMOL_PROMPTS)])
def test_tp2_tokens_and_logprobs_equal_tp1(server, pair, prompts):
    one, two = (client(server, m) for m in pair)
    for p in prompts:
        a = one.generate(p, max_tokens=16, temperature=0.0, return_log_probs=True)
        b = two.generate(p, max_tokens=16, temperature=0.0, return_log_probs=True)
        assert b.token_ids == a.token_ids and len(a.token_ids) > 0
        assert b.text == a.text
        assert np.allclose(b.log_probs, a.log_probs, atol=1e-4, rtol=0), (p, b.log_probs, a.log_probs)


def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def test_two_instances_both_serve(server, engines):
    """instance_group count 2: two engines, each with its own worker, and concurrent requests
    keep both busy (each worker's CPU time grows; an idle worker only wakes for heartbeats)."""
    workers = processes_with(engines["tiny2"])
    assert len(workers) == 2, workers
    before = {pid: _cpu_ticks(pid) for pid in workers}
    ref = client(server, "tiny1").generate(PROMPTS[0], max_tokens=48, temperature=0.0, min_tokens=48).token_ids
    results, errors = [None] * 12, []

    def one(i):
        try:
            results[i] = client(server, "tiny2").generate(PROMPTS[0], max_tokens=48, temperature=0.0,
                                                          min_tokens=48).token_ids
        except Exception as e:  # reported below
            errors.append(e)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors and all(r == ref for r in results)
    grew = {pid: _cpu_ticks(pid) - before[pid] for pid in workers}
    assert all(v >= 3 for v in grew.values()), f"CPU ticks per worker: {grew} (one instance idle?)"


def test_killed_worker_fails_requests_and_marks_model_unhealthy(server, engines):
    from tritium.client.triton_client import TritiumClientError
    (worker,) = processes_with(engines["smol2"])
    os.kill(worker, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(TritiumClientError, match="worker rank 1 exited with code -9"):
        client(server, "smol2").generate("Hello", max_tokens=4, temperature=0.0)
    # Rank 0 sees the exit before the step, or within comm.LIVENESS_POLL_S (0.1 s) while a
    # collective waits for the dead rank, whatever the load. The bound is half the collective
    # timeout these tests set (TEST_TIMEOUT_S, 120 s): a failure that came from that timeout
    # (a run under load once took exactly 120.0 s) fails here; the rest is slack for a busy host.
    assert time.monotonic() - t0 < float(TEST_TIMEOUT_S) / 2
    wait_for(lambda: metric(scrape(server), "tritium_engine_healthy", model="smol2") == 0.0, timeout=20)
    assert metric(scrape(server), "tritium_engine_healthy", model="smol1") == 1.0
    # the other models keep serving
    assert client(server, "smol1").generate("Hello", max_tokens=2, temperature=0.0).token_ids


def test_unloading_a_model_stops_its_workers(server, engines):
    import tritonclient.grpc as grpcclient
    assert len(processes_with(engines["tiny2"])) == 2
    c = grpcclient.InferenceServerClient(server.grpc_url)
    c.unload_model("tiny2", headers=server.headers("grpc", admin=True))  # the admin key: docs/security.md
    assert not wait_no_workers(engines["tiny2"], timeout=30)
    assert client(server, "tiny1").generate("Hello", max_tokens=2, temperature=0.0).token_ids
