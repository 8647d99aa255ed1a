"""ThreadPolicy: how many torch intra-op threads an engine step uses, by its size."""
from __future__ import annotations

from typing import Dict, Optional

import torch

# Steps with fewer tokens than this are "small" (a few decodes).
SMALL_STEP_TOKENS = 4
# Steps of up to this many tokens run the native decode step (backend/models/native_step.py).
MID_STEP_TOKENS = 32
MID_CLASSES = ("mid4", "mid8", "mid16")


class ThreadTuner:
    """Picks the faster of two thread counts for one class of steps, online, by measuring.

    Steps of a few tokens are memory-bound and run as one OpenMP region whose threads meet at a
    barrier between ops (kernels/cpu_decode_layer.c). On an idle host two threads stream the
    weights up to 1.5x faster than one; when other processes take the cores (the server's
    frontend and response path, other jobs), a preempted thread stalls its peers at every barrier
    and two threads ran 3-10x slower than one (measured in-process on the shared 2-core host).
    Which count wins depends on the engine, the host and its load at the time, so the policy
    measures: it runs the current best count, records seconds per token of every step (an
    exponential moving average), and every `interval` steps runs the other count for a few steps
    (one, when it is over twice as slow as the best). The faster one becomes the best; an
    exploration that loses doubles the interval (up to MAX_INTERVAL, so a count that is 10x slower
    costs at most a few percent), one that wins resets it.

    The bits of a step do not depend on its thread count (the native step splits output channels,
    never a sum), so switching changes speed only."""

    ALPHA = 0.2          # weight of a new step in the moving average
    EXPLORE_STEPS = 2    # steps on the other count per exploration
    ABORT_RATIO = 2.0    # an exploration step this much slower than the best ends it at once
    MIN_INTERVAL, MAX_INTERVAL = 16, 1024

    def __init__(self, counts):
        self.counts = tuple(dict.fromkeys(counts))
        self.best = self.counts[0]
        self.cost: Dict[int, Optional[float]] = {c: None for c in self.counts}
        self.interval = self.MIN_INTERVAL
        self._since = 0          # steps on `best` since the last exploration
        self._exploring = None   # the count being explored
        self._explore_left = 0
        self._explore_costs = []

    def choose(self) -> int:
        if self._exploring is not None:
            return self._exploring
        if len(self.counts) > 1 and self._since >= self.interval:
            self._exploring = next(c for c in self.counts if c != self.best)
            self._explore_left, self._explore_costs = self.EXPLORE_STEPS, []
            return self._exploring
        return self.best

    def observe(self, count: int, seconds_per_token: float) -> None:
        if self._exploring is not None and count == self._exploring:
            self._explore_left -= 1
            self._explore_costs.append(seconds_per_token)
            best_cost = self.cost[self.best]
            if self._explore_left <= 0 or (best_cost is not None and seconds_per_token > self.ABORT_RATIO * best_cost):
                self._finish_exploration()
            return
        if count != self.best:
            return
        self._since += 1
        old = self.cost[count]
        self.cost[count] = seconds_per_token if old is None else old + self.ALPHA * (seconds_per_token - old)

    def _finish_exploration(self) -> None:
        other, self._exploring, self._since = self._exploring, None, 0
        fresh = sum(self._explore_costs) / len(self._explore_costs)
        self.cost[other] = fresh
        best_cost = self.cost[self.best]
        if best_cost is not None and fresh < best_cost:
            self.best, self.interval = other, self.MIN_INTERVAL
        else:
            self.interval = min(2 * self.interval, self.MAX_INTERVAL)


class ThreadPolicy:
    """torch intra-op threads per step: `threads` for big steps (more than MID_STEP_TOKENS
    tokens: prefill, GEMM-bound); for small steps (fewer than SMALL_STEP_TOKENS tokens) and mid
    steps (up to MID_STEP_TOKENS: the native decode step), `small_step_threads` (small steps) and
    `threads` (mid steps) when small_step_threads is given, else a ThreadTuner per size class
    choosing between one thread and `threads`. Servers also run with
    OMP_WAIT_POLICY=PASSIVE (client/serve/server.py): idle OpenMP threads that spin take the core
    a preempted worker needs (at load 16 a batch of 16 decoded at 64.4 tokens/s with it against
    2.1 without, docs/quantization.md, "Build time on shared cores")."""

    def __init__(self, threads: int, small_step_threads: Optional[int] = None):
        for name, v in (("num_threads", threads), ("small_step_threads", small_step_threads)):
            if v is None and name == "small_step_threads":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        self.threads, self.small_step_threads = threads, small_step_threads
        self.tuners: Dict[str, ThreadTuner] = {}
        if small_step_threads is None and threads > 1:
            # one tuner per size class: seconds per token fall with the step's size, so only steps
            # of like size are compared
            self.tuners = {cls: ThreadTuner((threads, 1)) for cls in ("small",) + MID_CLASSES}
        self._last = None  # (class, threads) of the step being run

    @staticmethod
    def step_class(num_tokens: int) -> str:
        """small (< SMALL_STEP_TOKENS), mid4 / mid8 / mid16 (up to MID_STEP_TOKENS, by powers of
        two) or big."""
        if num_tokens < SMALL_STEP_TOKENS:
            return "small"
        if num_tokens > MID_STEP_TOKENS:
            return "big"
        return "mid4" if num_tokens < 8 else "mid8" if num_tokens < 16 else "mid16"

    def threads_for(self, num_tokens: int) -> int:
        cls = self.step_class(num_tokens)
        if cls in self.tuners:
            return self.tuners[cls].choose()
        return self.small_step_threads if cls == "small" and self.small_step_threads else self.threads

    def apply(self, num_tokens: int) -> None:
        n = self.threads_for(num_tokens)
        self._last = (self.step_class(num_tokens), n)
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)

    def observe(self, num_tokens: int, seconds: float) -> None:
        """The step that apply() prepared took `seconds` for `num_tokens` tokens."""
        if self._last is None or num_tokens < 1:
            return
        cls, n = self._last
        self._last = None
        if cls in self.tuners:
            self.tuners[cls].observe(n, seconds / num_tokens)

    def describe(self) -> str:
        if not self.tuners:
            return f"threads {self.threads}, small steps {self.small_step_threads or self.threads}"
        best = ", ".join(f"{cls} steps {t.best} (interval {t.interval})" for cls, t in self.tuners.items())
        return f"threads {self.threads}, tuned: {best}"
