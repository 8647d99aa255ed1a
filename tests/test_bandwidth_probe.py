"""The single-stream bandwidth share measured in the same seconds (client/bench/bandwidth_probe.py,
docs/benchmarks.md "The bandwidth share"): the arithmetic against hand computations from recorded
numbers, the probe's place around each request with fake drivers, the real probe's reading, and
the report lines of `tritium bench` / `tritium compare`."""
from __future__ import annotations

import threading
import time

import pytest

from tritium.client.bench.bandwidth_probe import (ReadProbe, format_share, probe_for_host,
                                                  request_share, request_tok_s, share_report, shares_of_run,
                                                  start_of_run_share)
from tritium.client.bench.bench_drivers import RequestResult
from tritium.client.bench.bench_report import summarize
from tritium.client.bench.bench_runner import run_requests
from tritium.client.bench.bench_suite import SuiteOptions, run_suite
from tritium.client.bench.bench_workload import BenchRequest, WorkloadSpec

pytestmark = pytest.mark.usefixtures("one_thread")
INT8_BYTES = 149830368  # the int8 compare engine's weight bytes (docs/benchmarks.md)


def test_share_arithmetic_against_hand_computation():
    # A request sent at 10.000 s whose final response (128 tokens) arrived at 10.640 s: 128 / 0.640 =
    # 200 tok/s. Probes 33.0 and 37.0 GB/s, mean 35.0; 200 x 149830368 B = 29966073600 B/s;
    # / 35e9 = 0.856173531...
    assert request_tok_s(128, 10.000, 10.640) == pytest.approx(200.0)
    assert request_share(200.0, INT8_BYTES, 33.0, 37.0) == pytest.approx(0.8561735314, rel=1e-9)
    assert request_tok_s(128, 10.0, None) is None and request_tok_s(0, 10.0, 11.0) is None
    # Three requests: 200 tok/s over probes 33 / 37 -> 0.85617; 250 tok/s over 60 / 64 (mean 62):
    # 250 x 149830368 = 37457592000 / 62e9 = 0.604154710; 180 tok/s over 34 / 36 (mean 35):
    # 26969466240 / 35e9 = 0.770556178. Median 0.770556178; probes 33-64 GB/s.
    rep = share_report([{"tok_s": 200.0, "probe_gbs": [33.0, 37.0]},
                        {"tok_s": 250.0, "probe_gbs": [60.0, 64.0]},
                        {"tok_s": 180.0, "probe_gbs": [34.0, 36.0]}], INT8_BYTES)
    assert rep["request_shares"] == pytest.approx([0.8561735314, 0.6041547097, 0.7705561783], rel=1e-9)
    assert rep["share"] == pytest.approx(0.7705561783, rel=1e-9)
    assert (rep["probe_gbs_min"], rep["probe_gbs_max"], rep["requests"]) == (33.0, 64.0, 3)
    assert rep["tok_s_median"] == 200.0
    # The start-of-run figure: 165.1 tok/s x 149830368 B / 64.2 GB/s = 24736993757 / 64.2e9 = 0.385311429.
    assert start_of_run_share(165.1, INT8_BYTES, 64.2) == pytest.approx(0.3853114292, rel=1e-9)
    assert share_report([], INT8_BYTES) is None and share_report([{"tok_s": 1.0, "probe_gbs": [1, 1]}], 0) is None


class _Log:
    def __init__(self):
        self.events, self.lock = [], threading.Lock()

    def add(self, what):
        with self.lock:
            self.events.append(what)


class FakeDriver:
    """Streams `max_tokens` chunks 1 ms apart and logs when each request starts and ends."""
    in_process = False

    def __init__(self, name, log):
        self.name, self.log = name, log

    def describe(self):
        return {"driver": self.name}

    def session(self):
        return self

    def run(self, req, request_id):
        self.log.add(("send", self.name, req.index))
        res = RequestResult(req.index, req.max_tokens, time.perf_counter())
        for _ in range(req.max_tokens):
            time.sleep(0.001)
            res.chunk_times.append(time.perf_counter())
            res.chunk_tokens.append(1)
        res.num_output_tokens, res.t_end = req.max_tokens, time.perf_counter()
        self.log.add(("end", self.name, req.index))
        return res

    def close(self):
        pass


class FakeProbe:
    """Logs each call, sleeps `secs` (so its time is visible in the run's duration) and returns
    the next of `values`."""

    def __init__(self, log, values, secs=0.05):
        self.log, self.values, self.secs, self.n = log, list(values), secs, 0

    def __call__(self):
        self.log.add(("probe",))
        time.sleep(self.secs)
        self.n += 1
        return self.values[(self.n - 1) % len(self.values)]


def test_probe_runs_just_before_and_after_every_request_and_its_time_is_not_the_runs():
    log = _Log()
    probe = FakeProbe(log, [30.0, 34.0, 60.0, 62.0, 33.0, 35.0])
    reqs = [BenchRequest(i, f"p{i}", 2, 4) for i in range(3)]
    run = run_requests(FakeDriver("a", log), reqs, 1, "single", progress=False, probe=probe)
    assert log.events == [("probe",), ("send", "a", 0), ("end", "a", 0), ("probe",),
                          ("probe",), ("send", "a", 1), ("end", "a", 1), ("probe",),
                          ("probe",), ("send", "a", 2), ("end", "a", 2), ("probe",)]
    assert [r.probe_gbs for r in run.results] == [[30.0, 34.0], [60.0, 62.0], [33.0, 35.0]]
    # the probes before each request and after the first two fall inside the run: 5 of them
    assert run.probe_s >= 5 * 0.05
    wall = run.results[-1].t_end - run.results[0].t_send
    assert run.duration_s < wall and run.duration_s + run.probe_s >= wall
    s = summarize(run)
    assert [p["probe_gbs"] for p in s["probed_requests"]] == [[30.0, 34.0], [60.0, 62.0], [33.0, 35.0]]
    for p, r in zip(s["probed_requests"], run.results):  # 4 tokens over send -> final response
        assert p["tok_s"] == pytest.approx(4 / (r.t_end - r.t_send))
    with pytest.raises(ValueError, match="concurrency must be 1"):
        run_requests(FakeDriver("a", log), reqs, 2, "c2", progress=False, probe=probe)
    plain = summarize(run_requests(FakeDriver("a", log), reqs, 1, "single", progress=False))
    assert "probed_requests" not in plain


def test_suite_probes_only_the_single_streams_of_every_system():
    log = _Log()
    probe = FakeProbe(log, [40.0], secs=0.0)
    opts = SuiteOptions(WorkloadSpec(3, (4, 6), (2, 3), seed=1), [2], None, single_stream=2,
                        single_stream_words=4, single_stream_tokens=3, warmup=0, progress=False)
    result, _ = run_suite({"a": FakeDriver("a", log), "b": FakeDriver("b", log)}, opts, probe=probe)
    first_probe = log.events.index(("probe",))  # the c2 run (3 requests a system) is not probed
    assert first_probe == 2 * 3 * 2 and all(e[0] == "probe" or e[2] < 2 for e in log.events[first_probe:])
    assert sum(e == ("probe",) for e in log.events) == 2 * 2 * 2  # 2 systems x 2 requests x before / after
    for system in ("a", "b"):
        by = {s["label"]: s for s in result["runs"][system]}
        assert "probed_requests" not in by["c2"] and len(by["single"]["probed_requests"]) == 2
    shares = shares_of_run(result["runs"], {"a": INT8_BYTES}, 64.0)
    assert set(shares) == {"a"} and shares["a"]["same_second"]["probe_gbs_min"] == 40.0
    dec = [p["tok_s"] for p in next(s for s in result["runs"]["a"] if s["label"] == "single")["probed_requests"]]
    want = sorted(d * INT8_BYTES / 40e9 for d in dec)
    assert shares["a"]["same_second"]["share"] == pytest.approx((want[0] + want[1]) / 2)


def test_real_probe_reads_with_the_headlines_threads_and_pages():
    import torch
    host = {"memory": {"threads": 1, "buffer_mb": 512, "read_pages": "4KiB", "read_gbs": 10.0}}
    probe = probe_for_host(host, passes=2)
    assert probe.describe() == {"threads": 1, "buffer_mb": 128, "pages": "4KiB", "passes": 2}
    torch.set_num_threads(1)
    g = probe()
    assert g > 0 and len(probe.readings) == 1 and probe.readings[0]["gbs"] == g
    two = ReadProbe(2, 8, "2MiB", passes=2)  # 2 MiB pages where the host has them, else 4 KiB
    assert two.pages in ("2MiB", "4KiB") and two() > 0 and torch.get_num_threads() == 1  # threads restored
    assert probe_for_host({}) is None
    with pytest.raises(ValueError, match="pages"):
        ReadProbe(1, 8, "1GiB")


def test_share_lines_name_both_figures():
    s = {"same_second": share_report([{"tok_s": 200.0, "probe_gbs": [33.0, 37.0]}], INT8_BYTES),
         "start_of_run": 0.385, "start_of_run_read_gbs": 64.2, "weight_bytes": INT8_BYTES}
    line = format_share("tritium-serve", s)
    assert line.startswith("tritium-serve: 86 % of the same-second read (median of 1 requests")
    assert "probes 33.0-37.0 GB/s; median 200.0 tok/s" in line and "start-of-run figure 38 % (read 64.2 GB/s at the start)" in line
    assert "no same-second figure" in format_share("x", {"same_second": None, "start_of_run": None})


def test_compare_summary_pools_the_probed_requests_of_every_repeat():
    from tritium.client.bench.compare_report import format_table, summary

    def single(tok_s, probed):
        return {"label": "single", "output_tok_s": tok_s, "ttft_ms": None, "itl_ms": None, "e2e_ms": None,
                "errors": 0, "count_mismatches": 0, "client_cores": 0.1, "probed_requests": probed}
    reps = [{"runs": {"llama-server": [single(80.0, [])],
                      "tritium-serve": [single(160.0, [{"tok_s": 200.0, "probe_gbs": [33.0, 37.0]}])],
                      "in-process": [single(170.0, [{"tok_s": 250.0, "probe_gbs": [60.0, 64.0]}])]}},
            {"runs": {"llama-server": [single(82.0, [])],
                      "tritium-serve": [single(170.0, [{"tok_s": 180.0, "probe_gbs": [34.0, 36.0]},
                                                       {"tok_s": 250.0, "probe_gbs": [60.0, 64.0]}])],
                      "in-process": [single(180.0, [])]}}]
    rep = summary({"int8": {"reps": reps, "idle_server_cores": {}, "llama_server_cmd": [],
                            "weight_bytes": INT8_BYTES, "read_gbs": 64.2}}, ["int8"])
    sh = rep["pairs"]["int8"]["bandwidth_share"]
    # tritium serve: the three requests of the hand computation above, median 0.770556178;
    # start-of-run: mean tok/s 165.0 x 149830368 / 64.2e9 = 0.385078049
    assert sh["tritium-serve"]["same_second"]["share"] == pytest.approx(0.7705561783, rel=1e-9)
    assert sh["tritium-serve"]["start_of_run"] == pytest.approx(0.3850780486, rel=1e-9)
    assert sh["in-process"]["same_second"]["requests"] == 1 and "llama-server" not in sh
    assert [p["probe_gbs"] for p in sh["tritium-serve"]["probed_requests"]] == [[33.0, 37.0], [34.0, 36.0], [60.0, 64.0]]
    table = format_table(rep)
    assert "single-stream bandwidth share" in table and "int8  tritium-serve: 77 % of the same-second read" in table


def test_benchmark_flags_are_documented_and_bad_ones_name_themselves(capsys, tmp_path):
    """Every flag of `tritium bench` / `compare` in docs/benchmarks.md's tables (`--flag`), every flag
    of `bench-openai` in docs/openai.md; --served-engine and --api-key refuse bad values naming the flag."""
    import os

    from tritium.client.cli.main import build_parser, main
    sub = build_parser()._subparsers._group_actions[0].choices
    root = os.path.join(os.path.dirname(__file__), "..", "docs")
    docs = {name: open(os.path.join(root, name), encoding="utf-8").read() for name in ("benchmarks.md", "openai.md")}
    for cmd, doc, forms in (("bench", "benchmarks.md", ("`{}",)), ("compare", "benchmarks.md", ("`{}",)),
                            ("bench-openai", "openai.md", ("{} ", "{}]"))):  # its usage block
        flags = [o for a in sub[cmd]._actions for o in a.option_strings if o.startswith("--") and o != "--help"]
        assert [f for f in flags if not any(x.format(f) in docs[doc] for x in forms)] == [], cmd
    for argv, flag in ((["bench", "--engine", str(tmp_path), "--served-engine", str(tmp_path)], "--served-engine"),
                       (["bench", "--url", "127.0.0.1:1", "--served-engine", str(tmp_path)], "--served-engine"),
                       (["bench", "--url", "127.0.0.1:1", "--api-key", "short"], "--api-key"),
                       (["compare", "--api-key", "has space in it, long enough"], "--api-key"),
                       (["bench", "--engine", str(tmp_path), "--probe-max-wait-ms", "-1"], "--probe-max-wait-ms"),
                       (["bench", "--engine", str(tmp_path), "--probe-quiet-cores", "-0.5"], "--probe-quiet-cores"),
                       (["compare", "--probe-max-wait-ms", "-5"], "--probe-max-wait-ms")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert flag in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
