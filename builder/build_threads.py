"""Thread settings for the builder's quantization passes on a shared CPU.

GPTQ's column loop (gptq.py, gptq_rows.py) and the clipping grid searches run thousands of
small torch ops per linear (vectors of N = 576..1536 values). Each op above torch's grain size
is one OpenMP parallel region, and a region ends only when every thread reaches its barrier: on
a host whose cores are also busy with other work, one descheduled OpenMP thread stalls the
region for a scheduler time slice while the other spins (libgomp's default wait policy). Measured
on SmolLM2's MLP shape (1536 x 576, act-order, group 64) on 2 shared cores at load 6: 2 threads
took 2.5-7.5 s, 1 thread 0.14-0.22 s, and 2 threads with OMP_WAIT_POLICY=passive 0.20 s. At load
14-16 (2026-11-25; awq_search and awq_clip_int4 on two random 1536 x 576 weights),
AWQ's scale search took 85 s on 2 threads with the default policy, 41-46 s on 1 thread and
16-17 s on 2 threads with passive waiting; its clipping search 16-21 s, 1.8-3.0 s and 0.4-0.8 s.
So these loops run on one thread when the weight has few rows (they are latency-bound there; a
second thread bought nothing even on a quiet host); an LM head's 49,152 rows make each op big
enough to keep every thread. The `tritium` command also sets OMP_WAIT_POLICY=passive
(client/cli/main.py), which removes the spinning for every other pass.
"""
from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def torch_threads(n: int):
    """Run the block with n torch intra-op threads (at most the current count), then restore it."""
    old = torch.get_num_threads()
    n = max(1, min(n, old))
    if n != old:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n != old:
            torch.set_num_threads(old)


SMALL_LOOP_ROWS = 8192  # at most this many rows: a column loop's ops are too small for threads


def column_loop_threads(num_rows: int) -> int:
    """Threads for a GPTQ-style column loop over a weight of num_rows rows."""
    return 1 if num_rows <= SMALL_LOOP_ROWS else torch.get_num_threads()
