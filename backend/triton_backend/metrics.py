"""Prometheus metrics of the `tritium` backend, through pb_utils.MetricFamily.

They appear on tritonserver's /metrics endpoint, each labelled with model and version:
histograms of time to first token and request latency, the inter-token latency histogram
as counters (CounterHistogram: one IPC per changed series a flush, not one per token); counters of prompt
tokens, generated tokens, preemptions, speculative decoding's proposed and accepted tokens
and (mixture-of-experts models) tokens routed to each expert
(acceptance rate = accepted / proposed; tokens per step = generated / engine steps); gauges of KV-cache blocks and requests by state.
`pb_utils` is passed in so this module imports without a server.
"""
from __future__ import annotations

import bisect
import threading

from tritium.backend.triton_backend.lora_metrics import LoRAMetrics

# Latency buckets in seconds: 1 ms .. 60 s, roughly x2.5 apart (CPU decode steps are ~10-100 ms).
LATENCY_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]


def le_label(bound: float) -> str:
    """A bucket bound as Triton's histograms print it: 0.0025, 1, 60, +Inf."""
    return "+Inf" if bound == float("inf") else f"{bound:g}"


class CounterHistogram:
    """A Prometheus histogram kept in this process and published as counters: NAME_bucket{le=...}
    (cumulative: values <= le), NAME_sum and NAME_count, the series a histogram NAME exposes,
    each family of TYPE counter. Observing only counts here; publish() sends the deltas since the
    last publish, one increment per series that changed, where a pb_utils histogram costs one IPC
    round trip to tritonserver per observed value (the inter-token latency: one per token)."""

    def __init__(self, mf, name: str, desc: str, labels: dict, buckets, families: list):
        self.bounds = list(buckets) + [float("inf")]

        def family(suffix, what):
            fam = mf(name=name + suffix, description=f"{desc} ({what})", kind=mf.COUNTER)
            families.append(fam)  # must stay referenced while its metrics are used
            return fam
        fam = family("_bucket", "histogram buckets: values <= le")
        self._buckets = [fam.Metric(labels=dict(labels, le=le_label(b))) for b in self.bounds]
        self._sum = family("_sum", "histogram sum").Metric(labels=dict(labels))
        self._count = family("_count", "histogram count").Metric(labels=dict(labels))
        self._pending = [0] * len(self.bounds)  # values per bucket (not cumulative) since publish()
        self._pending_sum = 0.0

    def observe(self, value: float) -> None:
        self._pending[bisect.bisect_left(self.bounds, value)] += 1
        self._pending_sum += value

    def publish(self) -> None:
        total = 0
        for i, n in enumerate(self._pending):
            total += n                   # cumulative: bucket le=b counts every value <= b
            if total:
                self._buckets[i].increment(total)
        if total:
            self._sum.increment(self._pending_sum)
            self._count.increment(total)
        self._pending = [0] * len(self.bounds)
        self._pending_sum = 0.0


class TritiumMetrics:
    """Owns the metric families of one model instance; thread-safe updates."""

    def __init__(self, pb_utils, model: str, version: str):
        mf = pb_utils.MetricFamily
        labels = {"model": model, "version": str(version)}
        self._lock = threading.Lock()

        def hist(name, desc):
            fam = mf(name=name, description=desc, kind=mf.HISTOGRAM)
            return fam, fam.Metric(labels=labels, buckets=LATENCY_BUCKETS)

        def one(name, desc, kind, extra=None):
            fam = mf(name=name, description=desc, kind=kind)
            return fam, fam.Metric(labels=dict(labels, **(extra or {})))

        # Families must stay referenced for as long as their metrics are used.
        self._families = []
        f, self.ttft = hist("tritium_time_to_first_token_seconds", "Time from arrival to the first output token")
        self._families.append(f)
        self.itl = CounterHistogram(mf, "tritium_inter_token_latency_seconds", "Time between consecutive output "
                                    "tokens", labels, LATENCY_BUCKETS, self._families)
        f, self.e2e = hist("tritium_request_latency_seconds", "Time from arrival to the last output token")
        self._families.append(f)
        f, self.prompt_tokens = one("tritium_prompt_tokens_total", "Prompt tokens processed", mf.COUNTER)
        self._families.append(f)
        f, self.generation_tokens = one("tritium_generation_tokens_total", "Tokens generated", mf.COUNTER)
        self._families.append(f)
        f, self.preemptions = one("tritium_preemptions_total", "Requests preempted for lack of KV blocks",
                                  mf.COUNTER)
        self._families.append(f)
        # Engine steps: generated tokens / steps is the mean decode batch (in-flight batching at work).
        f, self.steps = one("tritium_engine_steps_total", "Engine steps (schedule -> run -> postprocess)",
                            mf.COUNTER)
        self._families.append(f)
        kv = mf(name="tritium_kv_cache_blocks", description="KV-cache blocks by state", kind=mf.GAUGE)
        self._families.append(kv)
        self.kv = {s: kv.Metric(labels=dict(labels, state=s)) for s in ("used", "free", "cached")}
        rq = mf(name="tritium_requests", description="Engine requests by state", kind=mf.GAUGE)
        self._families.append(rq)
        self.requests = {s: rq.Metric(labels=dict(labels, state=s)) for s in ("running", "waiting")}
        f, self.rejected = one("tritium_rejected_requests_total", "Requests refused because the waiting queue "
                               "was full (max_queue_size)", mf.COUNTER, {"reason": "overloaded"})
        self._families.append(f)
        f, self.healthy = one("tritium_engine_healthy", "1 while the engine loop runs, 0 once it died", mf.GAUGE)
        self._families.append(f)
        f, self.spec_proposed = one("tritium_spec_proposed_tokens_total",
                                    "Speculative decoding: proposed tokens verified by the target", mf.COUNTER)
        self._families.append(f)
        f, self.spec_accepted = one("tritium_spec_accepted_tokens_total",
                                    "Speculative decoding: proposed tokens the target accepted", mf.COUNTER)
        self._families.append(f)
        self._spec_seen = {"spec_proposed_tokens": 0, "spec_accepted_tokens": 0}
        self._mf, self._labels = mf, labels
        self._expert_tokens = None  # mixture of experts: one counter per expert, made on first use
        self._expert_seen: list = []
        self.lora = LoRAMetrics(pb_utils, labels)  # per adapter: tritium_lora_*_total
        self._preemptions_seen = 0
        self._steps_seen = 0
        self._rejected_seen = 0
        self._pending_times = []      # (arrival, token times) of finished sequences
        self._pending_prompt = 0
        self._pending_generated = 0
        self._gauge_values = {}       # id(gauge) -> the value last set

    def observe_token_times(self, arrival: float, token_times: list) -> None:
        """Queue one finished sequence's TTFT, inter-token gaps and end-to-end latency (sent by flush)."""
        if not token_times:
            return
        with self._lock:
            self._pending_times.append((arrival, token_times))

    def add_tokens(self, prompt_tokens: int, generated_tokens: int) -> None:
        """Count tokens (sent by flush)."""
        with self._lock:
            self._pending_prompt += prompt_tokens
            self._pending_generated += generated_tokens

    def flush(self) -> None:
        """Send what was counted and observed since the last flush. Every metric update is an IPC
        round trip to the server, so the per-token path only counts and this runs periodically."""
        with self._lock:
            times, self._pending_times = self._pending_times, []
            prompt, self._pending_prompt = self._pending_prompt, 0
            generated, self._pending_generated = self._pending_generated, 0
            if prompt:
                self.prompt_tokens.increment(prompt)
            if generated:
                self.generation_tokens.increment(generated)
            for arrival, tt in times:
                self.ttft.observe(max(tt[0] - arrival, 0.0))
                for a, b in zip(tt, tt[1:]):
                    self.itl.observe(max(b - a, 0.0))
                self.e2e.observe(max(tt[-1] - arrival, 0.0))
            self.itl.publish()

    def _set(self, gauge, value: float) -> None:
        """Set a gauge when its value changed (each set is an IPC round trip to the server)."""
        if self._gauge_values.get(id(gauge)) != value:
            gauge.set(value)
            self._gauge_values[id(gauge)] = value

    def update_engine_stats(self, stats: dict) -> None:
        """Copy engine.stats() into the gauges; turn the cumulative preemption count into a counter."""
        with self._lock:
            for s in ("used", "free", "cached"):
                self._set(self.kv[s], float(stats.get(f"kv_blocks_{s}", 0)))
            self._set(self.requests["running"], float(stats.get("num_running", 0)))
            self._set(self.requests["waiting"], float(stats.get("num_waiting", 0)))
            total = int(stats.get("preemptions", 0))
            if total > self._preemptions_seen:
                self.preemptions.increment(total - self._preemptions_seen)
                self._preemptions_seen = total
            self._set(self.healthy, 1.0 if stats.get("healthy", True) else 0.0)
            rejected = int(stats.get("rejected", 0))
            if rejected > self._rejected_seen:
                self.rejected.increment(rejected - self._rejected_seen)
                self._rejected_seen = rejected
            for key, counter in (("spec_proposed_tokens", self.spec_proposed),
                                 ("spec_accepted_tokens", self.spec_accepted)):
                total = int(stats.get(key, 0))
                if total > self._spec_seen[key]:
                    counter.increment(total - self._spec_seen[key])
                    self._spec_seen[key] = total
            self._update_expert_tokens(stats.get("moe_expert_tokens"))
            self.lora.update(stats.get("lora", {}))
            steps = int(stats.get("num_steps", 0))
            if steps > self._steps_seen:
                self.steps.increment(steps - self._steps_seen)
                self._steps_seen = steps

    def _update_expert_tokens(self, counts) -> None:
        """tritium_moe_expert_tokens_total{expert=e}: tokens routed to expert e (summed over the
        sparse layers); the per-expert spread is the router's load balance."""
        if not counts:
            return
        if self._expert_tokens is None:
            fam = self._mf(name="tritium_moe_expert_tokens_total", kind=self._mf.COUNTER,
                           description="Mixture of experts: tokens routed to each expert, summed over layers")
            self._families.append(fam)
            self._expert_tokens = [fam.Metric(labels=dict(self._labels, expert=str(e))) for e in range(len(counts))]
            self._expert_seen = [0] * len(counts)
        for e, total in enumerate(counts):
            if total > self._expert_seen[e]:
                self._expert_tokens[e].increment(total - self._expert_seen[e])
                self._expert_seen[e] = total
