"""ParallelRunner: rank 0 of a tensor-parallel engine. It starts the workers (ranks 1..N-1) as
processes, broadcasts each step's inputs to them, runs its own shard, and samples the gathered
logits; the scheduler and the block manager live only here, and every rank's paged KV cache
(its own KV heads) uses the same block ids.

Failure handling: a worker that exits (crash, OOM kill) is seen before the next step, or while
a collective waits (its exit is checked every comm.LIVENESS_POLL_S, whatever the collective
timeout), or as a broken connection; the step then raises TensorParallelWorkerError naming
the rank and its exit code, the runner stops the other workers and stays failed (`healthy` is
False) until the engine is rebuilt. While idle, a heartbeat (an empty broadcast every
HEARTBEAT_S) keeps the workers' waits short of the collective timeout and notices a dead worker
without a request. close() stops the workers (then kills any left after STOP_TIMEOUT_S).

Ranks on other machines (multi-node; docs/tensor-parallel.md): TRITIUM_TP_LOCAL_RANKS = k
makes rank 0 start only ranks 1..k-1 and wait for ranks k..N-1, which an operator starts
elsewhere with `python -m tritium.backend.parallel.worker` and the same TRITIUM_TP_MASTER_ADDR
(this host's address as the others reach it) and TRITIUM_TP_MASTER_PORT.
"""
from __future__ import annotations

import atexit
import os
import select
import shutil
import subprocess
import sys
import threading
import time
from typing import List, Optional

import torch

from ..model_runner import ModelRunner
from ..placement import bind_thread
from . import step_message as msg
from .lora_sync import send_init, send_load
from .comm import TPGroup, destroy_group, free_port, init_group, timeout_s as default_timeout_s
from .handshake import agree_num_blocks
from ..parallel_layout import layout_from_config
from .worker import READY_LINE

HEARTBEAT_S = 5.0
STOP_TIMEOUT_S = 10.0
INIT_POLL_S = 0.05


class TensorParallelWorkerError(RuntimeError):
    """A tensor-parallel rank failed; the engine cannot run steps until it is reloaded."""


def worker_python() -> str:
    """The interpreter for workers: $TRITIUM_PYTHON, else this one when it is a Python (inside
    tritonserver, sys.executable is the backend stub), else python3 on PATH."""
    env = os.environ.get("TRITIUM_PYTHON")
    if env:
        return env
    if os.path.basename(sys.executable).startswith("python"):
        return sys.executable
    found = shutil.which("python3")
    if not found:
        raise TensorParallelWorkerError("no python3 on PATH to start tensor-parallel workers; set TRITIUM_PYTHON")
    return found


def worker_device(device: torch.device, rank: int) -> str:
    if device.type != "cuda":
        return str(device)
    base = device.index if device.index is not None else 0
    return f"cuda:{base + rank}"


class ParallelRunner(ModelRunner):
    """A ModelRunner whose run() drives every rank (see the module docstring)."""

    def __init__(self, engine_dir: str, cfg, model, device: torch.device, num_kv_blocks: Optional[int] = None,
                 kv_cache_memory_bytes: Optional[int] = None, threads_per_rank: Optional[int] = None,
                 master_addr: str = "127.0.0.1", timeout_s: Optional[float] = None,
                 gpu_memory_utilization: Optional[float] = None, instances_on_device: int = 1):
        n = cfg.tensor_parallel_size
        timeout_s = timeout_s or default_timeout_s()
        self.world_size = n
        self.workers: List[subprocess.Popen] = []
        self._lock = threading.Lock()
        self._error: Optional[str] = None
        self._closed = False
        self._last_use = time.monotonic()
        master_addr = os.environ.get("TRITIUM_TP_MASTER_ADDR", master_addr)
        port = int(os.environ.get("TRITIUM_TP_MASTER_PORT") or 0) or free_port(master_addr)
        local = int(os.environ.get("TRITIUM_TP_LOCAL_RANKS") or n)
        if not 1 <= local <= n:
            raise ValueError(f"TRITIUM_TP_LOCAL_RANKS must be in [1, {n}], got {local}")
        if local < n:
            print(f"tritium: tensor parallelism: waiting for ranks {local}..{n - 1} to join at "
                  f"{master_addr}:{port}", file=sys.stderr, flush=True)
        py = worker_python()
        for rank in range(1, local):
            cmd = [py, "-m", "tritium.backend.parallel.worker", "--engine-dir", os.path.abspath(engine_dir),
                   "--rank", str(rank), "--world-size", str(n), "--master-addr", master_addr,
                   "--master-port", str(port), "--device", worker_device(device, rank),
                   "--timeout", str(timeout_s), "--parent-pid", str(os.getpid())]
            if threads_per_rank:
                cmd += ["--threads", str(threads_per_rank)]
            self.workers.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE))
        atexit.register(self.close)
        try:
            self._wait_loaded(timeout_s)
            self._join(master_addr, port, device, timeout_s)
            self.tp = TPGroup(0, n, [r.vocab for r in layout_from_config(cfg)], device,
                              liveness=self._raise_if_worker_died, timeout_s=timeout_s)
            model.set_tensor_parallel(self.tp)
            blocks = agree_num_blocks(self.tp, cfg, 0, device, num_kv_blocks, kv_cache_memory_bytes, model,
                                      gpu_memory_utilization, instances_on_device)
        except BaseException:
            self.close()
            raise
        super().__init__(model.cfg, model, blocks, device, cfg.model.vocab_size)
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="tritium-tp-heartbeat", daemon=True)
        self._heartbeat.start()

    # ------------------------------------------------------------------ start-up
    def _wait_loaded(self, timeout_s) -> None:
        """Wait for each local worker's READY_LINE (its shard is loaded) before joining the group,
        so that a worker that cannot load fails the start-up at once, with its exit code."""
        deadline = time.monotonic() + timeout_s
        for rank, p in enumerate(self.workers, start=1):
            buf = b""
            while (READY_LINE + "\n").encode() not in buf:
                if p.poll() is not None:
                    raise TensorParallelWorkerError(f"tensor-parallel start-up failed: {self._dead_workers()} "
                                                    f"(its error is in the log above)")
                if time.monotonic() > deadline:
                    raise TensorParallelWorkerError(f"tensor-parallel start-up: worker rank {rank} did not load "
                                                    f"within {timeout_s} s")
                ready, _, _ = select.select([p.stdout], [], [], INIT_POLL_S)
                if ready:
                    chunk = os.read(p.stdout.fileno(), 4096)
                    if not chunk:  # the worker closed its end: it is exiting
                        p.wait(STOP_TIMEOUT_S)
                        continue
                    buf = (buf + chunk)[-4096:]

    def _join(self, addr, port, device, timeout_s) -> None:
        """init_process_group as rank 0, failing fast when a worker exits during start-up."""
        result: dict = {}

        def init():
            try:
                bind_thread(device)  # NCCL binds rank 0's communicator to the current device
                init_group(0, self.world_size, addr, port, device, timeout_s)
                result["ok"] = True
            except BaseException as e:  # reported by the polling loop below
                result["error"] = e
        t = threading.Thread(target=init, name="tritium-tp-init", daemon=True)
        t.start()
        deadline = time.monotonic() + timeout_s
        while t.is_alive():
            t.join(INIT_POLL_S)
            dead = self._dead_workers()
            if dead:
                raise TensorParallelWorkerError(f"tensor-parallel start-up failed: {dead} (its error is in "
                                                f"the log above)")
            if time.monotonic() > deadline:
                raise TensorParallelWorkerError(f"tensor-parallel start-up: workers did not join within {timeout_s} s")
        if "error" in result:
            raise TensorParallelWorkerError(f"tensor-parallel start-up failed: {result['error']}")

    def _dead_workers(self) -> str:
        gone = [(r + 1, p.returncode) for r, p in enumerate(self.workers) if p.poll() is not None]
        return ", ".join(f"worker rank {r} exited with code {c}" for r, c in gone)

    def _raise_if_worker_died(self) -> None:
        """TPGroup's liveness check while a collective waits: a dead local worker ends the wait."""
        dead = self._dead_workers()
        if dead:
            raise TensorParallelWorkerError(dead)

    def _why(self, e: Exception, default: str) -> str:
        """The failure of a step or heartbeat in words: the dead worker(s) first."""
        if isinstance(e, TensorParallelWorkerError):  # seen by the liveness check: the exit code is known
            return str(e)
        return f"{self._dead_workers_after_error() or default} ({type(e).__name__}: {' '.join(str(e).split())[:300]})"

    def _dead_workers_after_error(self, wait_s: float = 2.0) -> str:
        """After a failed collective: a killed worker's connection can break before its exit code
        can be read, so wait up to wait_s for one to show."""
        deadline = time.monotonic() + wait_s
        while True:
            dead = self._dead_workers()
            if dead or time.monotonic() > deadline:
                return dead
            time.sleep(0.05)

    # ------------------------------------------------------------------ health
    @property
    def healthy(self) -> bool:
        return self._error is None and not self._closed

    @property
    def failure(self) -> Optional[str]:
        """Why tensor parallelism failed (a worker's rank and exit code), or None."""
        return self._error

    def _fail(self, why: str) -> TensorParallelWorkerError:
        if self._error is None:
            self._error = why
            self._stop_workers(graceful=False)
        return TensorParallelWorkerError(f"tensor parallelism failed: {self._error}; the engine cannot run "
                                         f"steps until the model is reloaded")

    def _check(self) -> None:
        if self._closed:
            raise TensorParallelWorkerError("tensor-parallel engine is closed")
        if self._error is not None:
            raise self._fail(self._error)
        dead = self._dead_workers()
        if dead:
            raise self._fail(dead)

    def _heartbeat_loop(self) -> None:
        while not self._closed and self._error is None:
            time.sleep(HEARTBEAT_S / 5)
            if time.monotonic() - self._last_use < HEARTBEAT_S:
                continue
            with self._lock:
                if self._closed or self._error is not None:
                    return
                try:
                    self._check()
                except TensorParallelWorkerError:
                    return
                try:
                    self.tp.broadcast(msg.header(msg.OP_NOP))
                except Exception as e:  # a worker died while it waited, or a broken connection
                    self._fail(self._why(e, "a worker stopped answering"))
                    return
                self._last_use = time.monotonic()

    # ------------------------------------------------------------------ steps
    def enable_lora(self, manager) -> None:
        """Serve LoRA adapters on every rank: the workers build the same device slots, and each
        slot load and each step's rows are sent to them (backend/lora/tp.py)."""
        with self._lock:
            self._check()
            try:
                send_init(self.tp, manager)
            except Exception as e:
                raise self._fail(self._why(e, "a collective failed")) from None
            manager.record_loads = True
            self.lora = manager

    @torch.inference_mode()
    def run(self, sched) -> torch.Tensor:
        arrays = self.prepare_arrays(sched)
        with self._lock:
            self._check()
            try:
                rows = None
                if self.lora is not None:
                    self.lora.begin_step(sched.seqs, sched.num_new_tokens)
                    for slot, adapter in self.lora.take_loads():
                        send_load(self.tp, slot, adapter)
                    rows = self.lora.row_slots
                self.tp.broadcast(msg.header(msg.OP_STEP, arrays, lora_rows=rows is not None))
                self.tp.broadcast(msg.pack(arrays, rows))
                logits = self.execute(arrays)
            except Exception as e:
                raise self._fail(self._why(e, "a collective failed")) from None
            finally:
                self._last_use = time.monotonic()
                if self.lora is not None:
                    self.lora.end_step()
        return logits

    # ------------------------------------------------------------------ shutdown
    def _stop_workers(self, graceful: bool) -> None:
        if graceful:
            deadline = time.monotonic() + STOP_TIMEOUT_S
            for p in self.workers:
                try:
                    p.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        for p in self.workers:
            if p.poll() is None:
                p.kill()
        for p in self.workers:
            try:
                p.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
            if p.stdout is not None:
                p.stdout.close()

    def close(self) -> None:
        """Stop the workers and leave the process group (idempotent)."""
        if self._closed:
            return
        with self._lock:
            self._closed = True
            graceful = False
            if self._error is None and hasattr(self, "tp") and not self._dead_workers():
                try:
                    self.tp.broadcast(msg.header(msg.OP_STOP))
                    graceful = True
                except Exception:
                    graceful = False
            self._stop_workers(graceful)
            destroy_group()
        try:
            atexit.unregister(self.close)
        except Exception:
            pass
