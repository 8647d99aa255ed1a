"""ThreadPolicy: how many torch intra-op threads an engine step uses, by its size."""
from __future__ import annotations

import torch

# Steps with fewer tokens than this are "small" (a few decodes).
SMALL_STEP_TOKENS = 4


class ThreadPolicy:
    """torch intra-op threads per step: `threads` for big steps, `small_step_threads` for steps of
    fewer than SMALL_STEP_TOKENS tokens. In a server every core the engine does not use runs the
    frontend and the response path; during small, memory-bound steps those preempt OpenMP
    workers, which then stall at every barrier (measured on 2 cores through tritonserver: one
    thread decodes a single stream about 1.2x faster than two, while two threads serve a batch of
    16 about 1.15x faster than one). The native decode step runs a small step on several threads
    as one parallel region (kernels/cpu_decode_layer.c), one wake-up per step instead of one per
    GEMM; measured again with it through tritonserver on the loaded 2-core host, two threads
    still did not pay for a single stream (docs/benchmarks.md, "Native decode step"), so the
    default stays one fewer than num_threads. The stalls are far worse while idle OpenMP threads spin
    (libgomp's default): servers run with OMP_WAIT_POLICY=PASSIVE (client/serve/server.py), and at
    load 16 a batch of 16 decoded at 64.4 tokens/s with it against 2.1 without
    (docs/quantization.md, "Build time on shared cores")."""

    def __init__(self, threads: int, small_step_threads: int):
        for name, v in (("num_threads", threads), ("small_step_threads", small_step_threads)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        self.threads, self.small_step_threads = threads, small_step_threads

    def apply(self, num_tokens: int) -> None:
        n = self.small_step_threads if num_tokens < SMALL_STEP_TOKENS else self.threads
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
