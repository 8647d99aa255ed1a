"""The inter-token latency histogram published as counters (backend/triton_backend/metrics.py
CounterHistogram): after each flush the NAME_bucket{le} / NAME_sum / NAME_count series hold what a
Prometheus histogram of every value observed so far holds (bucket le = how many values are
<= le, cumulative; +Inf = count), computed here from the definition with numpy; a flush sends one
increment per series that changed, not one per value. The exposition through tritonserver is
checked by tests/test_serving_server.py::test_metrics_families_are_sane."""
from __future__ import annotations

import numpy as np

from tritium.backend.triton_backend.metrics import LATENCY_BUCKETS, TritiumMetrics, le_label


class FakeMetric:
    calls = 0

    def __init__(self, family, labels):
        self.family, self.labels, self.value = family, labels, 0.0

    def increment(self, v):
        FakeMetric.calls += 1
        assert v >= 0
        self.value += v

    def set(self, v):
        self.value = v

    def observe(self, v):
        FakeMetric.calls += 1
        self.family.observed.append(v)


class FakeFamily:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    made = {}

    def __init__(self, name, description, kind):
        self.name, self.kind, self.metrics, self.observed = name, kind, [], []
        FakeFamily.made[name] = self

    def Metric(self, labels=None, buckets=None):
        m = FakeMetric(self, dict(labels or {}))
        self.metrics.append(m)
        return m


class FakePb:
    MetricFamily = FakeFamily


def _series(name):
    return {m.labels.get("le"): m.value for m in FakeFamily.made[name].metrics}


def test_itl_counters_equal_the_histogram_definition():
    FakeFamily.made = {}
    metrics = TritiumMetrics(FakePb, "m", "1")
    assert "tritium_inter_token_latency_seconds" not in FakeFamily.made  # no per-value histogram
    for name in ("_bucket", "_sum", "_count"):
        assert FakeFamily.made["tritium_inter_token_latency_seconds" + name].kind == "counter"
    rng = np.random.default_rng(0)
    gaps_so_far = []
    for flush in range(3):
        for _ in range(5):  # finished sequences, each with its token times
            gaps = rng.choice([0.0, 0.001, 0.004, 0.0099, 0.01, 0.3, 70.0], size=rng.integers(1, 40))
            times = np.concatenate([[1.0], 1.0 + np.cumsum(gaps)])
            metrics.observe_token_times(0.5, times.tolist())
            gaps_so_far += np.diff(times).tolist()
        FakeMetric.calls = 0
        metrics.flush()
        # 5 TTFT + 5 e2e observations, and at most one increment per ITL series (16 buckets, sum, count)
        assert FakeMetric.calls <= 10 + len(LATENCY_BUCKETS) + 1 + 2 < len(gaps_so_far)
        g = np.maximum(np.array(gaps_so_far), 0.0)
        buckets = _series("tritium_inter_token_latency_seconds_bucket")
        want = {le_label(b): float(np.sum(g <= b)) for b in LATENCY_BUCKETS}
        want["+Inf"] = float(len(g))
        assert buckets == want
        assert _series("tritium_inter_token_latency_seconds_count") == {None: float(len(g))}
        assert abs(_series("tritium_inter_token_latency_seconds_sum")[None] - float(g.sum())) < 1e-9
    assert [le_label(b) for b in (0.0025, 1.0, 60.0, float("inf"))] == ["0.0025", "1", "60", "+Inf"]
    metrics.flush()  # nothing new: nothing sent
    assert _series("tritium_inter_token_latency_seconds_count") == {None: float(len(gaps_so_far))}
