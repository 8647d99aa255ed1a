"""Rank 0 notices a dead worker while a collective waits, without the collective timeout.

The hard case: the worker process is gone but its connection stays open (here a child it forked
holds its sockets), so gloo itself sees nothing until the timeout. TPGroup's liveness check
(checked every comm.LIVENESS_POLL_S) must end the wait with the worker's exit code.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

SCRIPT = r'''
import os, sys, subprocess, time, torch
from tritium.backend.parallel.comm import TPGroup, free_port, init_group
rank, port, use_liveness = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
RANGES = [(0, 1), (1, 2)]
if rank == 1:
    init_group(1, 2, "127.0.0.1", port, torch.device("cpu"), 60)
    TPGroup(1, 2, RANGES, "cpu").broadcast(torch.zeros(1))
    child = os.fork()
    if child == 0:  # keeps rank 1's sockets open after rank 1 is gone
        time.sleep(120)
        os._exit(0)
    print(child, flush=True)
    os._exit(7)
worker = subprocess.Popen([sys.executable, __file__, "1", str(port), "0"], stdout=subprocess.PIPE, text=True)

def liveness():
    if worker.poll() is not None:
        raise RuntimeError(f"worker rank 1 exited with code {worker.returncode}")

init_group(0, 2, "127.0.0.1", port, torch.device("cpu"), 60)
tp = TPGroup(0, 2, RANGES, "cpu", liveness=liveness if use_liveness else None, timeout_s=60)
tp.broadcast(torch.zeros(1))
holder = int(worker.stdout.readline())
worker.wait()
t0 = time.monotonic()
try:
    tp.all_reduce(torch.ones(4))
    print("no error")
except Exception as e:
    print(f"{type(e).__name__}: {e}; after {time.monotonic() - t0:.2f} s")
finally:
    os.kill(holder, 9)
    print(f"holder {holder}", flush=True)
    os._exit(0)
'''


def test_a_dead_worker_with_an_open_connection_ends_the_wait_at_once(tmp_path):
    script = tmp_path / "liveness.py"
    script.write_text(SCRIPT)
    from tritium.backend.parallel.comm import free_port
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, str(script), "0", str(free_port()), "1"], capture_output=True, text=True,
                       timeout=120, env=env)
    out = r.stdout
    holder = next((int(ln.split()[1]) for ln in out.splitlines() if ln.startswith("holder ")), None)
    if holder is not None:  # never leave the forked child behind, even when the asserts fail
        try:
            os.kill(holder, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert "worker rank 1 exited with code 7" in out, (out, r.stderr[-2000:])
    seconds = float(out.split("; after ")[1].split()[0])
    assert seconds < 5, out  # the collective timeout is 60 s: the liveness check ended the wait
