"""One console line per quantized layer: its seconds, the time so far and an estimate of the rest.

A line per layer (not a redrawn bar) so that the progress also reads in a log file or a CI
console, where a carriage-return bar shows nothing until it ends.
"""
from __future__ import annotations

import sys
import time


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class LayerProgress:
    """progress = LayerProgress("quantizing (int4-gptq)", 30); ...; progress.done(i) after each layer."""

    def __init__(self, what: str, num_layers: int, enabled: bool = True, stream=None):
        self.what, self.num_layers, self.enabled = what, num_layers, enabled
        self.stream = stream or sys.stderr
        self.start = self.last = time.monotonic()
        self.num_done = 0

    def done(self, layer: int) -> str:
        """Record that `layer` (0-based) finished; prints and returns its line."""
        now = time.monotonic()
        took, self.last = now - self.last, now
        self.num_done += 1
        elapsed = now - self.start
        left = elapsed / self.num_done * (self.num_layers - self.num_done)
        line = (f"{self.what}: layer {layer + 1}/{self.num_layers} in {took:.1f} s "
                f"(elapsed {_clock(elapsed)}, about {_clock(left)} left)")
        if self.enabled:
            print(line, file=self.stream, flush=True)
        return line
