"""The tensor-parallel process group: torch.distributed with gloo on CPU and NCCL on CUDA.

All ranks join one default process group over TCP (rank 0's address and a free port chosen at
start); one engine per process (a Triton model instance is its own process). Collectives:
all-reduce after the row-parallel layers and the vocab-parallel embedding, a gather of the
vocab-parallel logits onto rank 0, and rank 0's broadcast of each step's inputs.

Death detection does not wait for the collective timeout. On CPU, rank 0 (TPGroup.liveness set by
parallel/runner.py) starts each collective asynchronously and waits for it in slices of
LIVENESS_POLL_S; between slices it checks that every worker process is still alive and raises
at once if one has exited. Without this, a step could wait the whole timeout ($TRITIUM_TP_TIMEOUT_S,
300 s; 120 s in the tests) for a rank that is already gone: gloo notices a dead peer only
through its socket, and a killed worker on a loaded host made a request fail after exactly the
120 s test timeout. A collective that completes within the first slice costs nothing extra.
"""
from __future__ import annotations

import datetime
import os
import socket
import time
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 300.0
LIVENESS_POLL_S = 0.1  # rank 0 checks its workers this often while a collective waits


def timeout_s() -> float:
    """Collective timeout (seconds; $TRITIUM_TP_TIMEOUT_S, default 300): a rank that stops
    answering fails the step after this long."""
    return float(os.environ.get("TRITIUM_TP_TIMEOUT_S") or DEFAULT_TIMEOUT_S)


def backend_for(device: torch.device) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def init_group(rank: int, world_size: int, addr: str, port: int, device: torch.device,
               timeout: float) -> None:
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a torch.distributed group: one tensor-parallel "
                           "engine per process (close the other engine first)")
    dist.init_process_group(backend_for(device), init_method=f"tcp://{addr}:{port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout))


def destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


class TPGroup:
    """This rank's view of the group, handed to DecoderLM.set_tensor_parallel."""

    def __init__(self, rank: int, world_size: int, vocab_ranges: List[Tuple[int, int]], device: torch.device,
                 liveness: Optional[Callable[[], None]] = None, timeout_s: Optional[float] = None):
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        self.vocab_ranges = [tuple(v) for v in vocab_ranges]
        self.vocab_start, self.vocab_end = self.vocab_ranges[rank]
        self._width = max(e - s for s, e in self.vocab_ranges)  # gather needs equal shapes: pad
        # liveness() raises if a rank is gone (rank 0 watches its worker processes); None: wait
        # for each collective as torch.distributed does (NCCL, and the workers themselves).
        self.liveness = liveness if self.device.type != "cuda" else None
        self.timeout_s = timeout_s or DEFAULT_TIMEOUT_S

    def _wait(self, work) -> None:
        """Wait for an async collective, checking liveness every LIVENESS_POLL_S (module doc)."""
        if self.liveness is None:
            work.wait()
            return
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                work.wait(datetime.timedelta(seconds=LIVENESS_POLL_S))
                return
            except RuntimeError:
                if work.is_completed():  # the collective itself failed (a broken connection)
                    raise
                self.liveness()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"a collective did not complete within {self.timeout_s:.0f} s "
                                       f"(TRITIUM_TP_TIMEOUT_S)") from None

    def all_reduce(self, t: torch.Tensor) -> None:
        self._wait(dist.all_reduce(t, async_op=True))

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's tensor to every rank (in place on the others); host tensors move to the
        device and back for NCCL."""
        if self.device.type == "cuda":
            d = t.to(self.device)
            dist.broadcast(d, 0)
            t.copy_(d.cpu())
        else:
            self._wait(dist.broadcast(t, 0, async_op=True))
        return t

    def all_reduce_min(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        self._wait(dist.all_reduce(t, op=dist.ReduceOp.MIN, async_op=True))
        return int(t.item())

    def gather_logits(self, local: torch.Tensor):
        """(N, local vocab) on every rank -> (N, vocab) on rank 0, None elsewhere."""
        w = local.shape[1]
        if w < self._width:
            local = torch.nn.functional.pad(local, (0, self._width - w))
        local = local.contiguous()
        if self.rank != 0:
            self._wait(dist.gather(local, None, dst=0, async_op=True))
            return None
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        self._wait(dist.gather(local, parts, dst=0, async_op=True))
        return torch.cat([p[:, :e - s] for p, (s, e) in zip(parts, self.vocab_ranges)], dim=1)
