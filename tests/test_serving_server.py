"""Serving through a real tritonserver (nvidia-pytriton wheel) on loopback ports.

One server for the module: a tiny random Llama engine built by `tritium build ... --repo --name`,
its five models, plus two broken models loaded on demand. The oracle is the in-process
LLMEngine (greedy), and tritonclient / Triton's HTTP endpoints are the only way in.
"""
from __future__ import annotations

import json
import os
import queue
import shutil
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from serving_utils import cancel_beside_others, metric, raw_grpc, scrape, wait_for

pytestmark = pytest.mark.slow

NAME = "tiny"
SMALL_KV = "tiny_small_kv"   # the same engine with a 4-block KV pool, so concurrent requests preempt
SMALL_KV_BLOCKS = 4
IMPORTED = "tiny_imported"   # an engine imported from a compressed-tensors W4A16 checkpoint (builder/prequant/)
PROMPTS = ["Hello world, this is a test", "naïve café — 日本語のテキスト 🙂", "The quick brown fox"]


@pytest.fixture(scope="module")
def built(tiny_checkpoint, tmp_path_factory):
    """(engine_dir, repo_dir) from the real `tritium build` command."""
    from tritium.client.cli.main import main
    root = tmp_path_factory.mktemp("serving")
    engine, repo = str(root / "engine"), str(root / "repo")
    rc = main(["build", tiny_checkpoint("llama"), "-o", engine, "--dtype", "float32", "--max-batch-size", "32",
               "--quiet", "--repo", repo, "--name", NAME])
    assert rc == 0
    from tritium.builder.repository import llm_config
    os.makedirs(os.path.join(repo, SMALL_KV, "1"))
    with open(os.path.join(repo, SMALL_KV, "config.pbtxt"), "w") as f:
        f.write(llm_config(SMALL_KV, engine, 4, {"num_kv_blocks": SMALL_KV_BLOCKS}))
    # Broken models for the load-failure test (loaded on demand, not at start).
    for bad, eng in (("bad_path", str(root / "no_such_engine")), ("bad_config", str(root / "corrupt"))):
        os.makedirs(os.path.join(repo, bad, "1"))
        with open(os.path.join(repo, bad, "config.pbtxt"), "w") as f:
            f.write(llm_config(bad, eng, 4))
    os.makedirs(os.path.join(repo, "bad_budget", "1"))  # placement parameter out of range (docs/serving.md#placement)
    with open(os.path.join(repo, "bad_budget", "config.pbtxt"), "w") as f:
        f.write(llm_config("bad_budget", engine, 4, {"gpu_memory_utilization": "1.5"}))
    # A pre-quantized source made by compressed-tensors itself, imported by `tritium build`.
    from prequant_ct import float_source, make_ct_checkpoint
    ct = make_ct_checkpoint(float_source(str(root / "float128")), str(root / "ct_w4a16"), "W4A16_ASYM", group_size=32)
    assert main(["build", ct, "-o", str(root / "imported"), "--dtype", "float32", "--quiet"]) == 0
    os.makedirs(os.path.join(repo, IMPORTED, "1"))
    with open(os.path.join(repo, IMPORTED, "config.pbtxt"), "w") as f:
        f.write(llm_config(IMPORTED, str(root / "imported"), 4))
    shutil.copytree(engine, root / "corrupt")
    with open(root / "corrupt" / "engine.json", "w") as f:
        f.write('{"format_version": 1, "model": {"architecture": "llama"')  # truncated JSON
    return engine, repo, str(root)


@pytest.fixture(scope="module")
def server(built):
    from tritium.client.serve.server import TritonServer
    engine, repo, root = built
    models = [NAME, f"{NAME}_preprocessing", f"{NAME}_postprocessing", f"{NAME}_ensemble", f"{NAME}_bls", SMALL_KV,
              IMPORTED]
    srv = TritonServer(repo, log_file=os.path.join(root, "server.log"), load_models=models)
    srv.start(timeout=240)
    yield srv
    rc = srv.stop()
    assert rc == 0, "tritonserver did not exit cleanly"
    # no stub left behind: the process group is gone
    with pytest.raises(ProcessLookupError):
        os.killpg(srv.proc.pid, 0)


@pytest.fixture(scope="module")
def oracle(built):
    """Greedy reference from the in-process engine: prompt -> (token_ids, text)."""
    from tritium.backend.engine import LLMEngine
    from tritium.backend.sampling_params import SamplingParams
    eng = LLMEngine(built[0])
    cache = {}

    def ref(prompt: str, max_tokens: int):
        key = (prompt, max_tokens)
        if key not in cache:
            out = eng.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0))[0]
            cache[key] = (list(out.outputs[0].token_ids), out.outputs[0].text, len(out.prompt_token_ids))
        return cache[key]
    return ref


def client(server, protocol="grpc", model=NAME):
    from tritium.client.triton_client import TritiumClient
    return TritiumClient(server.grpc_url if protocol == "grpc" else server.http_url, protocol=protocol, model=model)


# ---- correctness against in-process greedy --------------------------------------------------------
@pytest.mark.parametrize("protocol", ["grpc", "http"])
@pytest.mark.parametrize("model", [NAME, f"{NAME}_ensemble", f"{NAME}_bls"])
def test_stream_equals_inprocess_greedy(server, oracle, protocol, model):
    c = client(server, protocol, model)
    for prompt in PROMPTS[:2]:
        ref_ids, ref_text, n_prompt = oracle(prompt, 12)
        chunks = list(c.stream(prompt, max_tokens=12, temperature=0.0))
        assert [t for ch in chunks for t in ch.token_ids] == ref_ids
        assert chunks[-1].finish_reason in ("length", "stop")
        assert sum(1 for ch in chunks if ch.finish_reason) == 1
        whole = c.generate(prompt, max_tokens=12, temperature=0.0)
        assert whole.token_ids == ref_ids and whole.num_input_tokens == n_prompt
        assert "".join(ch.text for ch in chunks) == whole.text  # deltas join to the whole text
        assert whole.text == ref_text


def test_stub_runs_the_tritium_of_the_server_process(server, built):
    """The Python backend's stub runs isolated (PYTHONPATH ignored); model.py puts PYTHONPATH first
    again, so the served code is this process's tritium, not whatever the venv has installed (with
    a checkout on PYTHONPATH the two differ). The model's load line names the package it runs."""
    import re
    import tritium.backend
    with open(os.path.join(built[2], "server.log"), encoding="utf-8", errors="replace") as f:
        log = f.read()
    found = re.findall(rf"model '{NAME}' serving engine .*?tritium\.backend from ([^)\"]+)\)", log)
    assert found, "the model's load line names no tritium.backend"
    here = os.path.realpath(os.path.dirname(tritium.backend.__file__))
    assert {os.path.realpath(p) for p in found} == {here}


def test_imported_prequantized_engine_serves_like_inprocess(server, built):
    from tritium.backend.engine import LLMEngine
    from tritium.backend.sampling_params import SamplingParams
    eng = LLMEngine(os.path.join(built[2], "imported"))
    assert eng.config.quantization.method == "imported"
    c = client(server, "grpc", IMPORTED)
    for prompt in PROMPTS[:2]:
        ref = eng.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0))[0].outputs[0]
        chunks = list(c.stream(prompt, max_tokens=12, temperature=0.0))
        assert [t for ch in chunks for t in ch.token_ids] == list(ref.token_ids)
        assert "".join(ch.text for ch in chunks) == ref.text


def test_echo_prompt_and_batch_rows(server, oracle):
    import tritonclient.grpc as grpcclient
    ref_ids, ref_text, _ = oracle(PROMPTS[0], 6)
    echo = client(server).generate(PROMPTS[0], max_tokens=6, temperature=0.0, exclude_input_in_output=False)
    assert echo.text == PROMPTS[0] + ref_text
    # batch of 2 rows in one request: served row by row, each response names its row
    results = queue.Queue()
    cl = grpcclient.InferenceServerClient(server.grpc_url)
    cl.start_stream(callback=lambda result, error: results.put((result, error)))
    text = grpcclient.InferInput("text_input", [2, 1], "BYTES")
    text.set_data_from_numpy(np.array([[PROMPTS[0].encode()], [PROMPTS[2].encode()]], dtype=np.object_))
    mt = grpcclient.InferInput("max_tokens", [2, 1], "INT32")
    mt.set_data_from_numpy(np.array([[6], [6]], dtype=np.int32))
    temp = grpcclient.InferInput("temperature", [2, 1], "FP32")
    temp.set_data_from_numpy(np.zeros((2, 1), dtype=np.float32))
    cl.async_stream_infer(NAME, [text, mt, temp], enable_empty_final_response=True)
    rows = {}
    try:
        while True:
            r, e = results.get(timeout=60)
            assert e is None, str(e)
            if r.get_response().outputs:
                rows[int(r.as_numpy("batch_index")[0, 0])] = [int(x) for x in r.as_numpy("output_ids").reshape(-1)]
            if r.get_response().parameters["triton_final_response"].bool_param:
                break
    finally:
        cl.stop_stream()
        cl.close()
    assert rows == {0: ref_ids, 1: oracle(PROMPTS[2], 6)[0]}


def test_samples_seed_and_logprobs_match_inprocess(server, built):
    """num_return_sequences, seed and return_log_probs against the in-process engine."""
    from tritium.backend.engine import LLMEngine
    from tritium.backend.sampling_params import SamplingParams
    ref = LLMEngine(built[0]).generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0.8, seed=11, n=2,
                                                                    logprobs=0))[0]
    for protocol in ("grpc", "http"):
        got = client(server, protocol).generate_all(PROMPTS[0], max_tokens=8, temperature=0.8, seed=11,
                                                    num_return_sequences=2, return_log_probs=True)
        assert [g.token_ids for g in got] == [list(o.token_ids) for o in ref.outputs]
        for g, o in zip(got, ref.outputs):
            want = [e["logprob"] for e in o.logprobs]
            assert np.allclose(g.log_probs, want, atol=1e-4)
            assert g.cum_log_prob == pytest.approx(sum(want), abs=1e-3)


def test_16_concurrent_streams_are_batched(server, oracle):
    time.sleep(0.3)  # metrics are flushed every 50 ms: let the previous test's counts land first
    before = scrape(server)
    prompts = [f"{PROMPTS[i % 3]} #{i}" for i in range(16)]
    refs = [oracle(p, 96)[0] for p in prompts]  # long enough to overlap whatever the arrival spread
    got, errors = [None] * 16, []
    barrier = threading.Barrier(16)
    clients = [client(server) for _ in range(16)]  # connections up before the requests start together
    assert all(c.is_ready() for c in clients)

    def run(i):
        try:
            barrier.wait()
            got[i] = [t for ch in clients[i].stream(prompts[i], max_tokens=96, temperature=0.0)
                      for t in ch.token_ids]
        except Exception as e:  # reported below
            errors.append(e)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert got == refs
    time.sleep(0.3)
    after = scrape(server)
    gen = metric(after, "tritium_generation_tokens_total", model=NAME) - metric(
        before, "tritium_generation_tokens_total", model=NAME)
    steps = metric(after, "tritium_engine_steps_total", model=NAME) - metric(
        before, "tritium_engine_steps_total", model=NAME)
    assert gen == sum(len(r) for r in refs)
    # One request alone yields one token per step; batched, a step yields one per running request.
    assert gen / steps > 4, f"{gen} tokens in {steps} steps: not batched"


def _kv_used(server) -> float:
    return metric(scrape(server), "tritium_kv_cache_blocks", model=NAME, state="used")


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_cancelled_stream_frees_kv_blocks(server, oracle, protocol):
    """A stream closed after 3 chunks is aborted (fewer than its 200 tokens generated, its blocks
    freed) while 6 others of 200 tokens run beside it (they also keep the steps long enough that
    the tiny model cannot finish the cancelled one before the cancellation is seen)."""
    assert wait_for(lambda: _kv_used(server) == 0), "KV blocks still used before the test"
    time.sleep(0.3)  # metrics are flushed every 50 ms: let earlier counts land first
    gen_before = metric(scrape(server), "tritium_generation_tokens_total", model=NAME)
    others, errors = cancel_beside_others(lambda: client(server), lambda: client(server, protocol),
                                          [f"{PROMPTS[2]} {i}" for i in range(6)], 200, PROMPTS[1], 200)
    assert not errors and others == [200] * 6, (errors, others)
    assert wait_for(lambda: _kv_used(server) == 0), "cancelled request kept its KV blocks"
    time.sleep(0.3)
    text = scrape(server)
    assert metric(text, "tritium_requests", model=NAME, state="running") == 0
    cancelled = metric(text, "tritium_generation_tokens_total", model=NAME) - gen_before - 6 * 200
    assert 3 <= cancelled < 200, f"the cancelled stream generated {cancelled} tokens: it was not cancelled"
    ref_ids, _, _ = oracle(PROMPTS[0], 8)
    assert client(server).generate(PROMPTS[0], max_tokens=8, temperature=0.0).token_ids == ref_ids


BAD_REQUESTS = [
    ("wrong dtype", dict(temperature=np.array([[1]], dtype=np.int32)), "temperature"),
    ("missing text_input", dict(text_input=None), "text_input"),
    ("max_tokens 0", dict(max_tokens=0), "max_tokens"),
    ("max_tokens negative", dict(max_tokens=-3), "max_tokens"),
    ("max_tokens huge", dict(max_tokens=10 ** 6), "max_tokens"),
    ("top_p 2", dict(top_p=2.0), "top_p"),
    ("NaN temperature", dict(temperature=float("nan")), "temperature"),
    ("empty prompt", dict(text_input=""), "text_input"),
    ("unknown sampling parameter", dict(sampling_parameters='{"temprature": 0.5}'), "temprature"),
]


@pytest.mark.parametrize("model", [NAME, f"{NAME}_ensemble"])
def test_bad_requests_name_the_field_and_spare_others(server, oracle, model):
    ref_ids, _, _ = oracle(PROMPTS[2], 40)
    inflight = client(server).stream(PROMPTS[2], max_tokens=40, temperature=0.0)
    got = list(next(inflight).token_ids)
    for label, change, field in BAD_REQUESTS:
        fields = {"text_input": PROMPTS[0], "max_tokens": 4}
        fields.update(change)
        outs, err = raw_grpc(server, model, fields)
        assert err is not None and field in err, f"{label}: error {err!r} does not name {field}"
        assert not outs, label
    got += [t for ch in inflight for t in ch.token_ids]
    assert got == ref_ids, "an in-flight request was disturbed by bad ones"
    assert server.is_ready()


def test_load_failures_give_one_line_reason(server, built):
    """Runs late: afterwards /v2/health/ready stays false (strict readiness)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException
    from tritium.client.serve.server import load_failures
    cl = grpcclient.InferenceServerClient(server.grpc_url)
    cases = (("bad_path", "does not exist"), ("bad_config", "engine.json: not valid JSON"),
             ("bad_budget", "parameter gpu_memory_utilization must be a number in"))
    try:
        for bad, reason in cases:
            with pytest.raises(InferenceServerException, match=reason):
                cl.load_model(bad, headers=server.headers("grpc", admin=True))  # docs/security.md
            assert not cl.is_model_ready(bad)
        with open(os.path.join(built[2], "server.log"), encoding="utf-8") as f:
            log = f.read().splitlines()
        for bad, reason in cases:
            line = next(ln for ln in log if f"failed to load '{bad}' version" in ln)
            first = line.split("\\n")[0]  # the reason comes before the (escaped) traceback
            assert "tritium: cannot load engine" in first and reason in first
            assert any(reason in ln for ln in load_failures(os.path.join(built[2], "server.log")))
        assert cl.is_model_ready(NAME) and cl.is_server_live()
    finally:
        for bad, _ in cases:
            cl.unload_model(bad, headers=server.headers("grpc", admin=True))
        cl.close()
    # (with --strict-readiness the server reports not-ready while a model is UNAVAILABLE) it serves on:
    assert client(server).generate(PROMPTS[0], max_tokens=3, temperature=0.0).num_output_tokens == 3


def test_metrics_families_are_sane(server):
    for protocol in ("grpc", "http"):  # some traffic, so the test also stands alone
        list(client(server, protocol).stream(PROMPTS[0], max_tokens=4, temperature=0.0))
    assert wait_for(lambda: _kv_used(server) == 0), "KV blocks still used after every request finished"
    time.sleep(0.3)  # gauges refresh every 50 ms
    text = scrape(server)
    lab = dict(model=NAME, version="1")
    for h in ("tritium_time_to_first_token_seconds", "tritium_inter_token_latency_seconds",
              "tritium_request_latency_seconds"):
        count = metric(text, h + "_count", **lab)
        assert count > 0
        assert metric(text, h + "_sum", **lab) > 0
        assert metric(text, h + "_bucket", le="+Inf", **lab) == count
    # each request's first token comes no later than its last one
    assert metric(text, "tritium_time_to_first_token_seconds_sum", **lab) <= metric(
        text, "tritium_request_latency_seconds_sum", **lab) + 1e-6
    assert metric(text, "tritium_prompt_tokens_total", **lab) > 0
    assert metric(text, "tritium_generation_tokens_total", **lab) >= metric(
        text, "tritium_request_latency_seconds_count", **lab)
    # this model's pool is sized from memory: nothing in this module comes near it
    assert metric(text, "tritium_preemptions_total", **lab) == 0
    assert metric(text, "tritium_engine_healthy", **lab) == 1
    assert metric(text, "tritium_rejected_requests_total", reason="overloaded", **lab) == 0
    free, cached = (metric(text, "tritium_kv_cache_blocks", state=s, **lab) for s in ("free", "cached"))
    assert free > 0 and cached > 0   # idle: prompts' full blocks stay cached for prefix reuse
    for s in ("running", "waiting"):
        assert metric(text, "tritium_requests", state=s, **lab) == 0


def test_preemption_under_kv_pressure_is_counted_and_leaks_nothing(server, oracle):
    """Four concurrent requests that each fit the 4-block pool alone but not together: requests
    are preempted and recomputed, every answer still equals the greedy oracle, the counter shows
    it, and once idle every block is back (free or cached)."""
    lab = dict(model=SMALL_KV, version="1")
    prompts = [f"{PROMPTS[2]} {i}" for i in range(4)]
    budget = SMALL_KV_BLOCKS * 16   # block_size 16
    want = []
    for p in prompts:
        _, _, n_prompt = oracle(p, 1)
        want.append(oracle(p, budget - n_prompt - 2))
        assert len(want[-1][0]) > 16, "the oracle stopped early: the requests would not fill the pool"
    got, errors = [None] * 4, []
    barrier = threading.Barrier(4)

    def run(i):
        try:
            c = client(server, model=SMALL_KV)
            barrier.wait()
            got[i] = c.generate(prompts[i], max_tokens=budget - want[i][2] - 2, temperature=0.0).token_ids
        except Exception as e:  # reported below
            errors.append(e)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert got == [w[0] for w in want]
    time.sleep(0.3)
    text = scrape(server)
    assert metric(text, "tritium_preemptions_total", **lab) > 0
    used, free, cached = (metric(text, "tritium_kv_cache_blocks", state=s, **lab) for s in ("used", "free", "cached"))
    assert used == 0 and used + free + cached == SMALL_KV_BLOCKS
    for s in ("running", "waiting"):
        assert metric(text, "tritium_requests", state=s, **lab) == 0


def test_generate_cli_url(server, oracle, capsys):
    from tritium.client.cli.main import main
    _, ref_text, _ = oracle(PROMPTS[1], 10)
    for protocol, url in (("grpc", server.grpc_url), ("http", server.http_url)):
        assert main(["generate", "--url", url, "--protocol", protocol, "--model", NAME, "--stream",
                     "--max-tokens", "10", PROMPTS[1]]) == 0
        assert capsys.readouterr().out == ref_text + "\n"
        assert main(["generate", "--url", url, "--protocol", protocol, "--model", f"{NAME}_ensemble", "--json",
                     "--max-tokens", "10", PROMPTS[1]]) == 0
        assert json.loads(capsys.readouterr().out)["text"] == ref_text
    assert main(["generate", "--url", server.grpc_url, "--model", NAME, "--top-p", "2", "x"]) == 2
    assert "top_p" in capsys.readouterr().err



def test_generate_cli_url_input_file(server, oracle, tmp_path, capsys):
    """--input-file: all lines go out together; results come back in input order."""
    from tritium.client.cli.main import main
    lines = [{"prompt": p, "max_tokens": 5 + i} for i, p in enumerate(PROMPTS)]
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(x, ensure_ascii=False) for x in lines) + "\n")
    capsys.readouterr()
    assert main(["generate", "--url", server.http_url, "--protocol", "http", "--model", NAME,
                 "--input-file", str(tmp_path / "in.jsonl")]) == 0
    got = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    assert [g["token_ids"] for g in got] == [oracle(x["prompt"], x["max_tokens"])[0] for x in lines]


def test_http_error_names_field(server):
    body = json.dumps({"text_input": "hi", "max_tokens": 0}).encode()
    req = urllib.request.Request(f"http://{server.http_url}/v2/models/{NAME}/generate", data=body)
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert "max_tokens" in e.value.read().decode()
