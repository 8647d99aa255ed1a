"""A background load for benchmarks: a process busy W ms of every P ms (as a server's delivery
thread, tritonserver and the client take a core for a moment), started and stopped around a
block (split_bench, workload_profile --load)."""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from typing import Tuple

_LOADER = r"""
import sys, time
w, p = float(sys.argv[1]) / 1e3, float(sys.argv[2]) / 1e3
t = time.perf_counter()
while True:
    e = t + w
    while time.perf_counter() < e:
        pass
    t += p
    d = t - time.perf_counter()
    if d > 0:
        time.sleep(d)
    else:
        t = time.perf_counter()
"""


def parse_load(s: str) -> Tuple[float, float]:
    try:
        w, p = (float(v) for v in s.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"load {s!r} is not W/P (busy W ms of every P ms, e.g. 1/4)")
    if not (0 <= w < p):
        raise argparse.ArgumentTypeError(f"load {s!r} needs 0 <= W < P")
    return w, p


class Load:
    """A process busy w ms of every p ms while the block runs (none when w == 0)."""

    def __init__(self, w: float, p: float):
        self.w, self.p, self.proc = w, p, None

    def __enter__(self):
        if self.w > 0:
            self.proc = subprocess.Popen([sys.executable, "-c", _LOADER, str(self.w), str(self.p)])
            time.sleep(0.2)
        return self

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait()
