"""Per-adapter Prometheus counters (docs/lora.md): requests, prompt tokens and generated tokens of
each LoRA adapter, labelled adapter="NAME" (or "task:ID" for tensorrtllm_backend's lora_task_id).
Fed from engine.stats()["lora"] (cumulative counts) by TritiumMetrics.update_engine_stats."""
from __future__ import annotations

FAMILIES = (("requests", "tritium_lora_requests_total", "Requests served with each LoRA adapter"),
            ("prompt_tokens", "tritium_lora_prompt_tokens_total", "Prompt tokens of requests with each LoRA adapter"),
            ("generated_tokens", "tritium_lora_generation_tokens_total", "Tokens generated with each LoRA adapter"))


class LoRAMetrics:
    def __init__(self, pb_utils, labels: dict):
        mf = pb_utils.MetricFamily
        self._labels = labels
        self._families = {key: mf(name=name, description=desc, kind=mf.COUNTER) for key, name, desc in FAMILIES}
        self._metrics = {}  # (adapter, key) -> metric
        self._seen = {}     # (adapter, key) -> count already sent

    def update(self, counters: dict) -> None:
        """counters: {adapter: {"requests", "prompt_tokens", "generated_tokens"}} (cumulative)."""
        for adapter, counts in counters.items():
            for key in self._families:
                total = int(counts.get(key, 0))
                k = (adapter, key)
                if total <= self._seen.get(k, 0):
                    continue
                if k not in self._metrics:
                    self._metrics[k] = self._families[key].Metric(labels=dict(self._labels, adapter=adapter))
                self._metrics[k].increment(total - self._seen.get(k, 0))
                self._seen[k] = total
