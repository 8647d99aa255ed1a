"""The bandwidth probe's watch (client/bench/cpu_watch.py, bandwidth_probe.ReadProbe.set_watch;
docs/benchmarks.md "The bandwidth share"): per-thread CPU of fake processes through fake
counters, the bounded wait for quiet on a fake clock, what a probe records and in which order,
and the summary figures against hand computations."""
from __future__ import annotations

import threading

import pytest

from tritium.client.bench import cpu_watch
from tritium.client.bench.bandwidth_probe import ReadProbe, format_share, share_report
from tritium.client.bench.bench_report import summarize
from tritium.client.bench.bench_runner import run_requests
from tritium.client.bench.bench_workload import BenchRequest
from tritium.client.bench.cpu_watch import (CpuWatch, busiest, busy_cores, host_cores, host_ticks, queued_cores,
                                           task_run_ns, wait_quiet)

pytestmark = pytest.mark.usefixtures("one_thread")
INT8_BYTES = 149830368


class FakeProc:
    """Fake /proc: {pid: {tid: [name, ns]}} and process groups {pgid: [pids]}; every read logged."""

    def __init__(self, tasks, groups):
        self.tasks, self.groups, self.reads = tasks, groups, []

    def read(self, pid):
        self.reads.append(pid)
        return {t: (v[0], v[1]) for t, v in self.tasks.get(pid, {}).items()}

    def members(self, pgid):
        return list(self.groups.get(pgid, []))

    def watch(self, pgids, exclude=()):
        return CpuWatch(pgids, exclude=exclude, read_tasks=self.read, list_group=self.members, self_pid=1)


def test_watch_samples_every_thread_of_each_group_and_this_process_less_the_probe():
    fp = FakeProc({1: {1: ["bench", 5], 2: ["probe-a", 7], 3: ["probe-b", 9], 4: ["engine", 11]},
                   100: {100: ["llama-server", 50], 101: ["llama-server", 60]},
                   200: {200: ["tritonserver", 70]}, 201: {201: ["triton_python", 80]}},
                  {100: [100], 200: [200, 201]})
    w = fp.watch({"llama": 100, "triton": 200}, exclude={2, 3})
    assert w.groups() == ["llama", "triton", "client", "probe"]
    s = w.sample(skip=(1,))  # the sampling thread left out of the client
    assert s == {"llama": {100: ("llama-server", 50), 101: ("llama-server", 60)},
                 "triton": {200: ("tritonserver", 70), 201: ("triton_python", 80)},
                 "probe": {2: ("probe-a", 7), 3: ("probe-b", 9)}, "client": {4: ("engine", 11)}}
    fp.groups[200].append(202)  # a process started later is seen after refresh() only
    fp.tasks[202] = {202: ["stub2", 1]}
    assert 202 not in w.sample()["triton"]
    w.refresh()
    assert w.sample()["triton"][202] == ("stub2", 1)
    with pytest.raises(ValueError, match="'client' or 'probe'"):
        fp.watch({"client": 5})


def test_busy_cores_and_busiest_against_hand_computation():
    a = {"srv": {10: ("x", 1_000_000), 11: ("y", 0)}, "client": {20: ("c", 500_000)}}
    # over 0.010 s: srv 10 ran 4 ms, 11 ran 1 ms, 12 (born in between) 0.5 ms: 5.5 ms -> 0.55 cores;
    # the client 20 ran 0.2 ms -> 0.02 cores; a thread gone by b counts nothing
    b = {"srv": {10: ("x", 5_000_000), 11: ("y", 1_000_000), 12: ("z", 500_000)}, "client": {20: ("c", 700_000)}}
    assert busy_cores(a, b, 0.010) == pytest.approx({"srv": 0.55, "client": 0.02})
    assert busiest(a, b, n=2) == [("srv", "x", 10, 4.0), ("srv", "y", 11, 1.0)]
    assert busiest(a, b, n=5, min_ns=600_000) == [("srv", "x", 10, 4.0), ("srv", "y", 11, 1.0)]
    with pytest.raises(ValueError, match="seconds"):
        busy_cores(a, b, 0.0)
    # run-queue waits (schedstat's 2nd field): 10 waited 3 ms, 11 (born in between) 1 ms -> 0.4 cores
    # over 10 ms; a sample without the field counts 0
    qa = {"probe": {10: ("p", 0, 2_000_000)}, "x": {1: ("x", 0)}}
    qb = {"probe": {10: ("p", 0, 5_000_000), 11: ("q", 0, 1_000_000)}, "x": {1: ("x", 5)}}
    assert queued_cores(qa, qb, 0.010) == pytest.approx({"probe": 0.4, "x": 0.0})


def test_real_schedstat_sees_a_busy_thread_and_its_own_process():
    import os
    import time
    me = threading.get_native_id()
    a = task_run_ns(os.getpid())[me]
    t = time.perf_counter()
    while time.perf_counter() - t < 0.05:  # 50 ms busy: run + waited for a CPU covers it
        pass
    b = task_run_ns(os.getpid())[me]
    assert len(b) == 3 and b[1] - a[1] + b[2] - a[2] >= 0.045e9 and b[1] > a[1]
    assert task_run_ns(2 ** 22 + 12345) == {}  # no such process


def test_host_ticks_from_a_proc_stat_line(tmp_path):
    p = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal: busy = 100+2+30+4+5 = 141, steal 7, all 141+7+500+9
    p.write_text("cpu  100 2 30 500 9 4 5 7 0 0\ncpu0 1 1 1 1 1 1 1 1 0 0\n")
    assert host_ticks(str(p)) == (141, 7, 657)
    hz = __import__("os").sysconf("SC_CLK_TCK")
    got = host_cores((141, 7, 657), (141 + hz, 7 + hz // 2, 657 + 2 * hz), 2.0)
    assert got == pytest.approx({"busy": 0.5, "steal": 0.25})


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t

    def sleep(self, s):
        self.t += s


def _scripted_watch(series):
    """A watch whose sample k returns the cumulative ns of series[k] ({group: ns})."""
    calls = []

    class W:
        def refresh(self):
            calls.append("refresh")

        def sample(self, skip=()):
            calls.append(("sample", tuple(skip)))
            k = sum(1 for c in calls if c != "refresh") - 1
            return {g: {1: ("t", ns)} for g, ns in series[min(k, len(series) - 1)].items()}
    return W(), calls


def test_wait_quiet_returns_at_the_first_quiet_poll():
    # polls 20 ms apart; the server ran 15, 8, then 1 ms per poll: 0.75, 0.4, 0.05 cores. The probe's
    # own threads (spinning 10 ms a poll: 0.5 cores) are not waited for.
    ms = 1_000_000
    w, calls = _scripted_watch([{"srv": 0, "probe": 0}, {"srv": 15 * ms, "probe": 10 * ms},
                                {"srv": 23 * ms, "probe": 20 * ms}, {"srv": 24 * ms, "probe": 30 * ms}])
    clock = FakeClock()
    got = wait_quiet(w, 0.1, 1.0, poll_s=0.02, clock=clock, sleep=clock.sleep, skip=(7,))
    assert got["quiet"] is True and got["polls"] == 3 and got["wait_s"] == pytest.approx(0.06)
    assert got["cores"] == pytest.approx({"srv": 0.05, "probe": 0.5})
    assert calls[0] == "refresh" and calls[1:] == [("sample", (7,))] * 4  # members looked up once, first


def test_wait_quiet_gives_up_at_the_bound_and_says_so():
    ms = 1_000_000
    w, _ = _scripted_watch([{"srv": k * 10 * ms} for k in range(100)])  # 0.5 cores for ever
    clock = FakeClock()
    got = wait_quiet(w, 0.1, 0.1, poll_s=0.02, clock=clock, sleep=clock.sleep)
    assert got["quiet"] is False and got["wait_s"] == pytest.approx(0.1) and got["polls"] == 5
    assert got["cores"]["srv"] == pytest.approx(0.5)
    once = wait_quiet(w, 0.1, 0.0, poll_s=0.02, clock=FakeClock(), sleep=lambda s: None)
    assert once["polls"] == 1  # max wait 0: one poll, whatever it saw
    with pytest.raises(ValueError, match="quiet_cores"):
        wait_quiet(w, -1, 1.0)


class LoggingWatch:
    """A CpuWatch stand-in: the server's counter moves 1 ms per sample; logs samples."""

    def __init__(self, log):
        self.log, self.n, self.exclude = log, 0, set()

    def groups(self):
        return ["srv", "client", "probe"]

    def refresh(self):
        pass

    def sample(self, skip=()):
        self.n += 1
        self.log.append(("sample", tuple(skip)))
        return {"srv": {9: ("srv", self.n * 1_000_000)}, "client": {}, "probe": {}}


def test_probe_waits_then_samples_around_its_read_and_records_it(monkeypatch):
    log = []
    probe = ReadProbe(1, 4, "4KiB", passes=1)
    assert probe.own_tids and threading.get_native_id() not in probe.own_tids  # its own thread(s)

    def fake_wait(watch, quiet, max_wait, skip=()):
        log.append(("wait", quiet, max_wait, tuple(skip)))
        return {"wait_s": 0.25, "quiet": True, "polls": 12, "cores": {"srv": 0.01, "client": 0.0, "probe": 0.0}}
    monkeypatch.setattr(cpu_watch, "wait_quiet", fake_wait)
    real = probe._best_seconds
    monkeypatch.setattr(probe, "_best_seconds", lambda: (log.append(("read",)), real())[1])
    w = LoggingWatch(log)
    probe.set_watch(w, quiet_cores=0.05, max_wait_s=0.5)
    assert w.exclude == probe.own_tids  # the probe's threads are not counted as the client
    me = (threading.get_native_id(),)
    g = probe()
    assert log == [("wait", 0.05, 0.5, me), ("sample", me), ("read",), ("sample", me)]
    r = probe.last_record()
    assert r["gbs"] == round(g, 2) and r["wait_ms"] == 250.0 and r["quiet"] is True
    assert r["cores_before"] == {"srv": 0.01, "client": 0.0, "probe": 0.0}
    # the server's counter moved 1 ms between the two samples around the read
    assert r["cores"]["srv"] == pytest.approx(1e-3 / probe.readings[-1]["s"], rel=0.01, abs=0.001)
    assert r["busiest"] == [["srv", "srv", 9, 1.0]] and set(r["host"]) == {"busy", "steal"}
    assert probe.describe()["watched"] == ["srv", "client", "probe"] and probe.describe()["max_wait_s"] == 0.5
    log.clear()
    probe.set_watch(w, max_wait_s=0.0)  # no wait: only the samples around the read
    probe()
    assert [e[0] for e in log] == ["sample", "read", "sample"] and "wait_ms" not in probe.last_record()
    probe.set_watch(None)
    log.clear()
    probe()
    assert log == [("read",)] and set(probe.readings[-1]) == {"t", "gbs", "s"}
    with pytest.raises(ValueError, match="quiet cores and max wait"):
        probe.set_watch(w, max_wait_s=-1)


class RecordingProbe:
    """A probe with a watch: GB/s from a list; last_record numbers its calls."""

    def __init__(self, values):
        self.values, self.n, self.watch = values, 0, object()

    def __call__(self):
        self.n += 1
        return self.values[self.n - 1]

    def last_record(self):
        return {"call": self.n, "wait_ms": 10.0 * self.n, "quiet": self.n != 2,
                "cores": {"srv": 0.01 * self.n, "client": 0.1, "probe": 1.5 + 0.1 * self.n},
                "probe_queued": [0.5, 0.1, 0.0, 0.2][self.n - 1]}


class Driver:
    in_process = False

    def describe(self):
        return {}

    def session(self):
        return self

    def run(self, req, rid):
        from tritium.client.bench.bench_drivers import RequestResult
        import time
        res = RequestResult(req.index, req.max_tokens, time.perf_counter())
        res.num_output_tokens, res.t_end = req.max_tokens, time.perf_counter() + 0.01
        return res

    def close(self):
        pass


def test_each_request_keeps_its_two_probes_records_in_order_and_the_summary_reads_them():
    probe = RecordingProbe([30.0, 60.0, 40.0, 40.0])
    run = run_requests(Driver(), [BenchRequest(i, "p", 2, 4) for i in range(2)], 1, "single",
                       progress=False, probe=probe)
    assert [[w["call"] for w in r.probe_watch] for r in run.results] == [[1, 2], [3, 4]]
    s = summarize(run)
    assert [[w["call"] for w in p["probe_watch"]] for p in s["probed_requests"]] == [[1, 2], [3, 4]]
    rep = share_report([{**p, "tok_s": 200.0} for p in s["probed_requests"]], INT8_BYTES)
    # before / after: 30/60 = 0.5 and 40/40 = 1.0 -> median 0.75; waits 10, 20, 30, 40 ms -> median 25;
    # probe 2 not quiet; servers' cores at most 0.04 (call 4); the probe's threads 1.6..1.9 -> median 1.75,
    # waiting for a CPU 0.5 0.1 0.0 0.2 -> median 0.15
    assert rep["before_after_median"] == pytest.approx(0.75)
    assert (rep["wait_ms_median"], rep["not_quiet"], rep["probes_watched"]) == (25.0, 1, 4)
    assert rep["server_cores_max"] == pytest.approx(0.04) and rep["client_cores_max"] == pytest.approx(0.1)
    assert rep["probe_cores_median"] == pytest.approx(1.75)
    assert rep["probe_queued_median"] == pytest.approx(0.15)  # 0.0 0.1 0.2 0.5
    # shares: 200 x 149830368 / 45e9 = 0.665912747, / 40e9 = 0.74915184; median 0.707532293
    assert rep["share"] == pytest.approx(0.7075322933, rel=1e-9)
    line = format_share("tritium-serve", {"same_second": rep, "start_of_run": None})
    assert "probe before / after median 0.75" in line
    assert ("[probes: waited median 25 ms for quiet, 1 of 4 gave up; during them servers <= 0.04 cores, "
            "client <= 0.10; the probe's threads median 1.75 cores on a CPU, 0.15 waiting for one]") in line
    plain = share_report([{"tok_s": 200.0, "probe_gbs": [30.0, 60.0]}], INT8_BYTES)
    assert "probes_watched" not in plain and "[probes:" not in format_share("x", {"same_second": plain})
