"""Start-up agreement between the ranks: every rank allocates the same number of KV blocks."""
from __future__ import annotations

import torch

from ..model_runner import num_blocks_for_budget
from ..parallel_layout import local_config


def agree_num_blocks(tp, cfg, rank: int, device, num_kv_blocks=None, kv_cache_memory_bytes=None) -> int:
    """Rank 0 passes the engine's num_kv_blocks / kv_cache_memory_bytes (None: per-device default);
    each rank works out what its own share of the KV heads fits, and all take the minimum (the
    block manager on rank 0 hands out the same block ids to every rank)."""
    req = torch.tensor([-1 if num_kv_blocks is None else num_kv_blocks,
                        -1 if kv_cache_memory_bytes is None else kv_cache_memory_bytes], dtype=torch.int64)
    tp.broadcast(req)
    blocks, budget = int(req[0]), int(req[1])
    if blocks < 0:
        blocks = num_blocks_for_budget(local_config(cfg, rank), torch.device(device), None if budget < 0 else budget)
    return tp.all_reduce_min(blocks)
