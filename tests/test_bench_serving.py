"""`tritium bench` serving modes: the seeded workload, the latency maths against numpy, and runs
against a real tritonserver (--url), a real OpenAI-style SSE endpoint (--openai-url) and the
in-process engine (--engine). No timed assertions: only counts and the order of timestamps."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from sse_endpoint import SSEEndpoint
from tritium.client.bench.bench_drivers import RequestResult
from tritium.client.bench.bench_openai import OpenAIDriver, completions_url
from tritium.client.bench.bench_report import distribution, itl_samples_s, summarize, tpot_s
from tritium.client.bench.bench_runner import RunResult, run_requests
from tritium.client.bench.bench_workload import (WorkloadSpec, make_requests, parse_concurrency, poisson_arrivals,
                                                 prose_words, single_stream_requests)
from tritium.client.cli.main import main

pytestmark = pytest.mark.usefixtures("one_thread")
NAME = "tiny"
# Small enough for the tiny engines' 256-token context (their tokenizer splits prose finely).
WORKLOAD = ["--num-requests", "5", "--prompt-words", "4", "14", "--output-len", "2", "7", "--seed", "3",
            "--warmup", "1", "--no-progress"]
SMALL = WORKLOAD + ["--single-stream", "2", "--single-stream-words", "6", "--single-stream-tokens", "5"]


def run_json(capsys, *argv):
    rc = main(list(argv))
    out = capsys.readouterr()
    assert rc == 0, out.err
    lines = [line for line in out.out.splitlines() if line.strip()]
    assert len(lines) == 1, "--json prints exactly one JSON object on stdout"
    return json.loads(lines[0]), out.err


def test_workload_is_fixed_by_seed_and_tag():
    spec = WorkloadSpec(40, (12, 384), (16, 256), seed=7)
    a, b = make_requests(spec, "x"), make_requests(spec, "x")
    assert a == b
    other_tag = make_requests(spec, "y")
    assert [(r.num_words, r.max_tokens) for r in other_tag] == [(r.num_words, r.max_tokens) for r in a]
    assert all(p.prompt != q.prompt for p, q in zip(a, other_tag))
    assert [r.max_tokens for r in make_requests(WorkloadSpec(40, (12, 384), (16, 256), seed=8))] != \
        [r.max_tokens for r in a]
    vocab = set(prose_words())
    for r in a:
        words = r.prompt.split()
        assert len(words) == r.num_words and 12 <= r.num_words <= 384 and 16 <= r.max_tokens <= 256
        assert words[:2] == ["Passage", f"x.{r.index}:"] and set(words[2:]) <= vocab
    assert len({r.prompt.split()[2] for r in a}) > 20  # windows start all over the text
    single = single_stream_requests(3, 12, 128, seed=0)
    assert [(r.num_words, r.max_tokens) for r in single] == [(12, 128)] * 3
    arr = poisson_arrivals(4000, 5.0, seed=1)
    assert arr == poisson_arrivals(4000, 5.0, seed=1) and arr[0] == 0.0 and np.all(np.diff(arr) >= 0)
    assert np.mean(np.diff(arr)) == pytest.approx(0.2, rel=0.05)
    assert poisson_arrivals(3, None) == [0.0, 0.0, 0.0]
    assert parse_concurrency("1,4,16,64") == [1, 4, 16, 64]


def test_latency_figures_match_numpy():
    rng = np.random.default_rng(0)
    results = []
    for i in range(7):
        n = int(rng.integers(1, 9))
        counts = rng.integers(1, 4, n).tolist()
        times = (1.0 + i + np.cumsum(rng.uniform(0.001, 0.2, n))).tolist()
        results.append(RequestResult(i, sum(counts), t_send=float(i), t_end=times[-1] + 0.01,
                                     chunk_times=times, chunk_tokens=counts, num_prompt_tokens=10 + i))
    results.append(RequestResult(7, 5, t_send=2.0, t_end=2.5, error="boom"))
    s = summarize(RunResult("c4", 4, None, results, duration_s=12.5, client_cpu_s=0.5))
    ok = results[:7]
    ttft = np.array([r.chunk_times[0] - r.t_send for r in ok]) * 1000
    itl = np.concatenate([np.repeat(np.diff(r.chunk_times) / np.array(r.chunk_tokens[1:]), r.chunk_tokens[1:])
                          for r in ok]) * 1000
    e2e = np.array([r.t_end - r.t_send for r in ok]) * 1000
    for key, ref in (("ttft_ms", ttft), ("itl_ms", itl), ("e2e_ms", e2e)):
        for p in (50, 90, 99):
            assert s[key][f"p{p}"] == pytest.approx(np.percentile(ref, p))
        assert s[key]["mean"] == pytest.approx(ref.mean()) and s[key]["n"] == ref.size
    assert len(itl) == sum(sum(r.chunk_tokens[1:]) for r in ok)
    tpots = [tpot_s(r) for r in ok if len(r.chunk_times) > 1]
    assert s["tpot_ms"]["n"] == len(tpots)
    r0 = next(r for r in ok if len(r.chunk_times) > 1)
    assert tpot_s(r0) == pytest.approx(np.mean(itl_samples_s(r0)))  # evenly spread gaps average to TPOT
    tokens = sum(sum(r.chunk_tokens) for r in ok)
    assert s["output_tokens"] == tokens and s["output_tok_s"] == pytest.approx(tokens / 12.5)
    assert s["request_s"] == pytest.approx(7 / 12.5) and s["errors"] == 1 and s["completed"] == 7
    assert s["error_examples"] == ["boom"] and s["count_mismatches"] == 0
    assert s["prompt_tokens"] == sum(10 + i for i in range(7)) and s["client_cores"] == pytest.approx(0.04)
    assert distribution([]) is None


@pytest.fixture(scope="module")
def served(tiny_checkpoint, tmp_path_factory):
    """(engine_dir, tritonserver) for a tiny engine built and served the way a user does it."""
    from tritium.client.serve.server import TritonServer
    root = tmp_path_factory.mktemp("bench")
    engine, repo = str(root / "engine"), str(root / "repo")
    assert main(["build", tiny_checkpoint("llama"), "-o", engine, "--dtype", "float32", "--quiet",
                 "--repo", repo, "--name", NAME]) == 0
    srv = TritonServer(repo, log_file=str(root / "server.log"), load_models=[NAME])
    srv.start(timeout=240)
    try:
        yield engine, srv
    finally:
        assert srv.stop() == 0


@pytest.mark.slow
def test_bench_url_json_against_real_server(served, capsys, tmp_path):
    """--url and --engine in one run: every request completes with exactly the requested tokens,
    both systems see the same prompt token counts, and the ratio is the tok/s ratio."""
    engine, srv = served
    res, err = run_json(capsys, "bench", "--url", srv.grpc_url, "--triton-protocol", "grpc", "--model", NAME,
                        "--engine", engine, "--concurrency", "1,3", "--json", "--plot", str(tmp_path / "plots"), "--bandwidth-mb", "16",
                        *SMALL)
    wl = make_requests(WorkloadSpec(5, (4, 14), (2, 7), seed=3))
    want = sum(r.max_tokens for r in wl)
    assert set(res["runs"]) == {"tritium-grpc", "in-process"} and res["triton_protocol"] == "grpc"
    assert "tritium read over grpc" in err
    for system, runs in res["runs"].items():
        assert [s["label"] for s in runs] == ["c1", "c3", "single"]
        for s in runs:
            assert s["errors"] == 0 and s["count_mismatches"] == 0 and s["completed"] == s["num_requests"]
            expect = want if s["label"] != "single" else 2 * 5
            assert s["output_tokens"] == s["requested_tokens"] == expect
            # one streamed response per generated token: ITL samples = tokens after each first one
            assert s["itl_ms"]["n"] == s["output_tokens"] - s["num_requests"]
            assert s["ttft_ms"]["p50"] <= s["e2e_ms"]["p99"] and s["ttft_ms"]["n"] == s["num_requests"]
            assert s["output_tok_s"] == pytest.approx(s["output_tokens"] / s["duration_s"])
            assert s["client_cpu_s"] >= 0
    grpc, inproc = ({s["label"]: s for s in res["runs"][n]} for n in ("tritium-grpc", "in-process"))
    for label in ("c1", "c3", "single"):
        assert grpc[label]["prompt_tokens"] == inproc[label]["prompt_tokens"] > 0
        assert res["ratios"]["tritium-grpc"][label] == pytest.approx(
            grpc[label]["output_tok_s"] / inproc[label]["output_tok_s"])
    assert res["ratios"]["reference"] == "in-process"
    assert sorted(os.listdir(tmp_path / "plots")) == ["itl_cdf.png", "throughput_vs_concurrency.png",
                                                      "ttft_cdf.png"]
    assert "tritium-grpc" in err and "c3" in err  # the table went to stderr
    from tritium.kernels import cpu_native
    host = res["host"]  # the host, as measured in this process with its thread count
    assert host["isa_path"] == cpu_native.isa() and host["memory"]["read_gbs"] > 0 and host["memory"]["buffer_mb"] == 16
    weights = sum(os.path.getsize(os.path.join(engine, f)) for f in os.listdir(engine) if f.endswith(".safetensors"))
    assert host["engine_weight_bytes"] == weights > 0
    assert host["bandwidth_limit_tok_s"] == pytest.approx(host["memory"]["read_gbs"] * 1e9 / weights)
    # the read probed just before and after each single stream of both systems, and the share from it
    assert res["bandwidth_probe"]["threads"] == host["memory"]["threads"] and "bandwidth share" in err
    assert res["bandwidth_probe"]["watched"] == ["client", "probe"] and res["bandwidth_probe"]["max_wait_s"] == 1.0
    for system in ("tritium-grpc", "in-process"):
        probed = next(s for s in res["runs"][system] if s["label"] == "single")["probed_requests"]
        assert len(probed) == 2 and all(len(p["probe_gbs"]) == 2 and min(p["probe_gbs"]) > 0 for p in probed)
        # each probe watched this process (its own threads apart) and waited at most the default 1000 ms
        assert all(len(p["probe_watch"]) == 2 and set(w["cores"]) == {"client", "probe"} and w["wait_ms"] <= 1100
                   for p in probed for w in [p["probe_watch"][0]])
        shares = sorted(p["tok_s"] * weights / (sum(p["probe_gbs"]) / 2 * 1e9) for p in probed)
        assert res["bandwidth_share"][system]["same_second"]["share"] == pytest.approx(sum(shares) / 2)
    assert err.startswith("host: ") or "\nhost: " in err


def test_triton_driver_shares_one_stream_and_reports_a_failed_request(served):
    """The Triton driver's sessions share one gRPC stream: concurrent requests of different lengths
    each get exactly their own tokens, one response per token; a request the server refuses
    fails alone (the only one in flight) and the stream serves the next ones."""
    import threading
    from tritium.client.bench.bench_drivers import TritonGrpcDriver
    from tritium.client.bench.bench_workload import BenchRequest
    _, srv = served
    drv = TritonGrpcDriver(srv.grpc_url, NAME)
    try:
        sessions = [drv.session() for _ in range(3)]
        assert len({id(s.stream) for s in sessions}) == 1
        reqs = [BenchRequest(i, f"Passage s.{i}: the river runs past", 5, 3 + 2 * i) for i in range(3)]
        out = [None] * 3
        threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, sessions[i].run(reqs[i], f"share-{i}")))
                   for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for r, q in zip(out, reqs):
            assert r.ok and r.num_output_tokens == q.max_tokens == sum(r.chunk_tokens) == len(r.chunk_tokens)
            assert r.num_prompt_tokens > 0 and r.chunk_times == sorted(r.chunk_times) and r.t_end >= r.chunk_times[-1]
        bad = sessions[0].run(BenchRequest(9, "Passage: too long", 3, 10 ** 6), "share-bad")
        assert not bad.ok and "max_tokens" in bad.error
        again = sessions[1].run(reqs[0], "share-again")
        assert again.ok and again.num_output_tokens == reqs[0].max_tokens
    finally:
        drv.close()


def test_bench_url_http_default_poisson_arrivals(served, capsys):
    """--url without --triton-protocol reads Triton's generate_stream (here through tritium serve's
    public HTTP port, the guard relaying the events): every request its exact tokens, one event each."""
    _, srv = served
    res, err = run_json(capsys, "bench", "--url", srv.http_url, "--model", NAME, "--request-rate", "50",
                        "--concurrency", "4", "--json", *WORKLOAD, "--single-stream", "0")
    assert res["triton_protocol"] == "http" and res["systems"]["tritium-http"]["driver"] == "triton-http"
    assert "tritium read over http" in err
    (s,) = res["runs"]["tritium-http"]
    assert s["label"] == "r50c4" and s["request_rate"] == 50 and s["errors"] == 0 and s["count_mismatches"] == 0
    assert s["output_tokens"] == s["requested_tokens"] == sum(r.max_tokens for r in
                                                              make_requests(WorkloadSpec(5, (4, 14), (2, 7), seed=3)))
    assert s["itl_ms"]["n"] == s["output_tokens"] - s["num_requests"] and s["prompt_tokens"] > 0


def test_triton_http_driver_matches_grpc_and_fails_a_refused_request_alone(served):
    """The generate_stream driver against tritonserver's own HTTP port and the gRPC driver get the
    same token ids, counts and text for the same greedy requests (one response per token); a
    request the model refuses (max_tokens beyond the context) fails alone with the server's error
    text while others on the same server run, and its session serves the next request."""
    import threading
    from tritium.client.bench.bench_drivers import TritonGrpcDriver
    from tritium.client.bench.bench_triton_http import TritonHttpDriver
    from tritium.client.bench.bench_workload import BenchRequest
    _, srv = served
    grpc = TritonGrpcDriver(srv.grpc_url, NAME, keep_token_ids=True)
    http = TritonHttpDriver(srv.triton_http_url, NAME, keep_token_ids=True)
    http.check()
    reqs = [BenchRequest(i, f"Passage h.{i}: the river runs past the old mill", 8, 3 + 3 * i) for i in range(3)]
    try:
        gs, hs = grpc.session(), [http.session() for _ in range(3)]
        want = [gs.run(q, f"g-{q.index}") for q in reqs]
        out = [None] * 4
        bad = BenchRequest(9, "Passage: too long", 3, 10 ** 6)
        jobs = [(i, hs[i], reqs[i]) for i in range(3)] + [(3, hs[0], bad)]
        threads = [threading.Thread(target=lambda i=i, s=s, q=q: out.__setitem__(i, s.run(q, f"h-{i}")))
                   for i, s, q in jobs[1:]]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        out[0] = hs[0].run(reqs[0], "h-0")  # after the refusal, on the same connection
        for g, h, q in zip(want, out[:3], reqs):
            assert g.ok and h.ok, (g.error, h.error)
            assert h.token_ids == g.token_ids and len(h.token_ids) == q.max_tokens
            assert h.num_output_tokens == g.num_output_tokens == q.max_tokens == len(h.chunk_tokens) == sum(h.chunk_tokens)
            assert h.num_prompt_tokens == g.num_prompt_tokens > 0 and h.text_chars == g.text_chars > 0
            assert h.t_send <= h.chunk_times[0] and h.chunk_times == sorted(h.chunk_times) and h.chunk_times[-1] <= h.t_end
        refused = out[3]
        assert not refused.ok and "max_tokens" in refused.error and "10000" in refused.error
        assert refused.chunk_tokens == []
        for s in hs:
            s.close()
    finally:
        grpc.close()


def test_triton_http_driver_refuses_bad_urls_naming_the_flag(served):
    from tritium.client.bench.bench_triton_http import TritonHttpDriver, generate_stream_url
    _, srv = served
    assert generate_stream_url("h:8000", "m") == generate_stream_url("http://h:8000/", "m") == \
        "http://h:8000/v2/models/m/generate_stream"
    with pytest.raises(ValueError, match="--url"):
        generate_stream_url("http://h:8000/v2", "m")
    with pytest.raises(ValueError, match="--model nope"):
        TritonHttpDriver(srv.triton_http_url, "nope").check()


def test_sse_reader_reads_data_lines_until_done():
    import io
    from tritium.client.bench.bench_sse import error_text, sse_data
    body = b'data: {"a": 1}\n\n: comment\nevent: x\ndata:{"b": 2}\r\n\ndata: [DONE]\n\ndata: {"c": 3}\n'
    got = list(sse_data(io.BytesIO(body)))
    assert [d for _, d in got] == [b'{"a": 1}', b'{"b": 2}'] and got[0][0] <= got[1][0]
    assert [d for _, d in sse_data(io.BytesIO(b'data: {"a": 1}\n'))] == [b'{"a": 1}']  # the body just ends
    assert error_text(b'{"error": "bad max_tokens"}') == "bad max_tokens"
    assert error_text(b'{"error": {"message": "m", "code": 400}}') == "m" and error_text(b"plain") == "plain"


def test_bench_openai_url_against_sse_endpoint(tiny_engine, capsys):
    """--openai-url against a real SSE endpoint: the bench sends what the workload says, and its
    counts and times agree with what the endpoint wrote (same clock, same process)."""
    eng = tiny_engine("llama")
    with SSEEndpoint(eng) as ep:
        res, _ = run_json(capsys, "bench", "--openai-url", ep.url, "--json", "--concurrency", "2", *SMALL)
        (c2, single) = res["runs"]["openai"]
        assert res["systems"]["openai"]["model"] == NAME  # taken from /v1/models
        sent = [b for b in ep.bodies if not b["prompt"].split()[1].startswith("warm")]
        wl = make_requests(WorkloadSpec(5, (4, 14), (2, 7), seed=3), tag="w0")
        assert sorted((b["prompt"], b["max_tokens"]) for b in sent[:5]) == \
            sorted((r.prompt, r.max_tokens) for r in wl)
        assert all(b["stream"] is True and b["ignore_eos"] is True and b["temperature"] == 0 for b in sent)
        for s, want in ((c2, sum(r.max_tokens for r in wl)), (single, 10)):
            assert s["errors"] == 0 and s["count_mismatches"] == 0 and s["output_tokens"] == want
            assert s["prompt_tokens"] > 0 and s["itl_ms"]["n"] == want - s["num_requests"]

        # The raw timings: send <= endpoint received < first write <= first chunk arrival.
        drv = OpenAIDriver(ep.url)
        drv.check()
        reqs = make_requests(WorkloadSpec(4, (4, 14), (2, 7), seed=5), tag="t")
        run = run_requests(drv, reqs, 2, "t", progress=False)
        for req, r in zip(reqs, run.results):
            log = ep.log[req.prompt]
            assert r.ok and r.t_send <= log["received"] < log["writes"][0] <= r.chunk_times[0]
            assert len(r.chunk_times) == len(log["writes"]) == req.max_tokens
            assert all(w <= t for w, t in zip(log["writes"], r.chunk_times)) and r.chunk_times[-1] <= r.t_end


def test_bench_openai_reports_token_count_mismatch(tiny_engine, capsys):
    with SSEEndpoint(tiny_engine("llama"), short_by=1, closing="vllm") as ep:
        res, err = run_json(capsys, "bench", "--openai-url", ep.url + "/v1", "--json", *SMALL)
    for s in res["runs"]["openai"]:
        assert s["count_mismatches"] == s["num_requests"] and s["errors"] == 0
        assert s["output_tokens"] == s["requested_tokens"] - s["num_requests"]
    assert "returned a different token count" in err


@pytest.mark.parametrize("argv,flag", [
    ([], "--url"), (["--engine", "x", "--concurrency", "0,4"], "--concurrency"),
    (["--engine", "x", "--prompt-len", "4", "8"], "--prompt-len"),
    (["--openai-url", "ftp://h:1"], "--openai-url"), (["--url", "127.0.0.1:1"], "--url"),
    (["--engine", "x", "--request-rate", "0"], "--request-rate"),
    (["--engine", "x", "--prompt-words", "9", "3"], "--prompt-words"),
    (["--url", "h:1", "--hf-baselines"], "--hf-baselines"), (["--url", "h:1/x"], "--url"),
    (["--url", "127.0.0.1:1", "--triton-protocol", "grpc"], "--url"), (["--engine", "x", "--bandwidth-mb", "-1"], "--bandwidth-mb")])
def test_bad_flags_exit_2_naming_the_flag(capsys, argv, flag):
    rc = main(["bench", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and flag in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_completions_url_forms():
    for u in ("http://h:8080", "http://h:8080/", "http://h:8080/v1", "h:8080/v1/completions"):
        assert completions_url(u) == "http://h:8080/v1/completions"


def test_client_nice_lowers_the_workers_and_the_threads_their_sessions_start():
    """--client-nice: every worker thread, and a thread its session starts (as tritonclient's
    reader is), runs at that nice value; this thread keeps its own; out-of-range values are refused."""
    import threading
    from tritium.client.bench.bench_suite import SuiteOptions
    from tritium.client.bench.bench_workload import BenchRequest

    def nice_of_this_thread():
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    seen = []

    class Session:
        def __init__(self):
            started = []
            t = threading.Thread(target=lambda: started.append(nice_of_this_thread()))
            t.start()
            t.join()
            seen.append(("reader", started[0]))

        def run(self, req, request_id):
            seen.append(("worker", nice_of_this_thread()))
            return RequestResult(req.index, req.max_tokens, 0.0, t_end=1.0)

        def close(self):
            pass

    class Driver:
        in_process = False

        def session(self):
            return Session()

        def describe(self):
            return {"driver": "nice-probe"}

    base = nice_of_this_thread()
    reqs = [BenchRequest(i, "p q", 2, 1) for i in range(4)]
    res = run_requests(Driver(), reqs, 2, "n", progress=False, client_nice=min(19, base + 7))
    assert len(res.results) == 4 and len(seen) == 2 + 4
    assert {v for _, v in seen} == {min(19, base + 7)} and nice_of_this_thread() == base
    for bad in (-1, 20):
        with pytest.raises(ValueError, match="--client-nice"):
            SuiteOptions(client_nice=bad).validate()
