"""A tensor-parallel worker: rank r >= 1 of an engine, started by rank 0 (parallel/runner.py).

    python -m tritium.backend.parallel.worker --engine-dir E --rank R --world-size N \\
        --master-addr 127.0.0.1 --master-port P [--device cpu] [--threads T]

It loads rank{R}.safetensors, joins the process group, agrees on the KV block count, then runs
every step rank 0 broadcasts until told to stop. It exits by itself when rank 0's process goes
away (checked twice a second) or a collective fails, so no worker outlives its engine.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

import torch

from ..loader import load_engine
from ..model_runner import ModelRunner
from ..placement import bind_thread
from . import step_message as msg
from .lora_sync import worker_init, worker_load
from .comm import TPGroup, destroy_group, init_group, timeout_s
from ..parallel_layout import layout_from_config
from .handshake import agree_num_blocks

PARENT_POLL_S = 0.5
READY_LINE = "tritium-worker-ready"


def _exit_with_parent(parent: int) -> None:
    def watch():
        while True:
            time.sleep(PARENT_POLL_S)
            if os.getppid() != parent:
                os._exit(3)
    threading.Thread(target=watch, name="tritium-tp-parent-watch", daemon=True).start()


def serve(args) -> int:
    device = torch.device(args.device)
    bind_thread(device)  # this rank's GPU (cuda:<base + rank>), before the load, NCCL and any kernel
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg, model, _ = load_engine(args.engine_dir, args.device, rank=args.rank)
    # Tell rank 0 the shard loaded (it joins the group only then), and send any later output of
    # this process to stderr so that the pipe is never written again.
    sys.stdout.flush()
    os.write(1, (READY_LINE + "\n").encode())
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    init_group(args.rank, args.world_size, args.master_addr, args.master_port, device, args.timeout or timeout_s())
    try:
        tp = TPGroup(args.rank, args.world_size, [r.vocab for r in layout_from_config(cfg)], device)
        model.set_tensor_parallel(tp)
        num_blocks = agree_num_blocks(tp, cfg, args.rank, device, model=model)
        runner = ModelRunner(model.cfg, model, num_blocks, device, cfg.model.vocab_size)
        h = torch.zeros(msg.HEADER_LEN, dtype=torch.int64)
        while True:
            tp.broadcast(h)
            op = int(h[0])
            if op == msg.OP_STOP:
                return 0
            if op == msg.OP_NOP:
                continue
            if op == msg.OP_LORA_INIT:
                runner.lora = worker_init(h, cfg, model, args.rank, device)
                continue
            if op == msg.OP_LORA_LOAD:
                worker_load(tp, h, runner.lora)
                continue
            payload = torch.empty(msg.payload_len(h), dtype=torch.int64)
            tp.broadcast(payload)
            rows = msg.lora_rows(h, payload)
            if rows is not None:
                runner.lora.begin_rows(rows)
            try:
                runner.execute(msg.unpack(h, payload))
            finally:
                if runner.lora is not None:
                    runner.lora.end_step()
    finally:
        destroy_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tritium.backend.parallel.worker")
    p.add_argument("--engine-dir", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--timeout", type=float, default=None,
                   help="collective timeout in seconds (default $TRITIUM_TP_TIMEOUT_S or 300)")
    p.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    args = p.parse_args(argv)
    # A Ctrl-C / SIGINT to the server's process group is for the server: the engine stops its
    # workers itself (close()), and they exit when rank 0's process is gone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent(args.parent_pid or os.getppid())
    try:
        return serve(args)
    except Exception as e:  # one line for the server log; rank 0 sees the broken connection
        print(f"tritium tensor-parallel worker rank {args.rank}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
