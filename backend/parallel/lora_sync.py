"""Rank 0 -> workers: LoRA turned on, adapters copied into device slots (backend/lora/tp.py)."""
from __future__ import annotations

import torch

from ..lora.layer import attach
from ..lora.manager import LoRAConfig, LoRAManager
from ..lora.tp import lora_shard, pack_load, unpack_load
from . import step_message as msg


def send_init(tp, manager: LoRAManager) -> None:
    tp.broadcast(msg.header(msg.OP_LORA_INIT, values=(manager.max_loras, manager.max_lora_rank)))


def send_load(tp, slot: int, adapter) -> None:
    table, values = pack_load(adapter)
    tp.broadcast(msg.header(msg.OP_LORA_LOAD, values=(slot, table.shape[0], values.numel())))
    tp.broadcast(table)
    tp.broadcast(values)


def worker_init(h: torch.Tensor, cfg, model, rank: int, device: torch.device) -> LoRAManager:
    """A worker's LoRAManager: the same slots as rank 0's, cut to this rank's part."""
    config = LoRAConfig({}, max_loras=int(h[1]), max_lora_rank=int(h[2]))
    manager = LoRAManager(cfg.model, config, device, model.dtype, shard=lora_shard(cfg, rank, model))
    attach(model, manager)
    return manager


def worker_load(tp, h: torch.Tensor, manager: LoRAManager) -> None:
    slot, m, v = int(h[1]), int(h[2]), int(h[3])
    table = tp.broadcast(torch.empty((m, 3), dtype=torch.int64))
    values = tp.broadcast(torch.empty(v, dtype=torch.float32))
    manager.load_slot(slot, unpack_load(manager.model_cfg, table, values), None)
