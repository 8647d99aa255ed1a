"""Start-up agreement between the ranks: every rank allocates the same number of KV blocks."""
from __future__ import annotations

import torch

from ..kv_budget import cuda_kv_blocks
from ..model_runner import num_blocks_for_budget
from ..parallel_layout import local_config


def agree_num_blocks(tp, cfg, rank: int, device, num_kv_blocks=None, kv_cache_memory_bytes=None,
                     model=None, gpu_memory_utilization=None, instances_on_device: int = 1) -> int:
    """Rank 0 passes the engine's num_kv_blocks / kv_cache_memory_bytes (None: per-device default)
    and its gpu_memory_utilization / instances_on_device; each rank works out what its own share of
    the KV heads fits (on CUDA: its GPU's budget less its shard's weights, docs/serving.md#placement),
    and all take the minimum (the block manager on rank 0 hands out the same block ids to every rank)."""
    util_ppm = -1 if gpu_memory_utilization is None else round(gpu_memory_utilization * 1e6)
    req = torch.tensor([-1 if num_kv_blocks is None else num_kv_blocks,
                        -1 if kv_cache_memory_bytes is None else kv_cache_memory_bytes,
                        util_ppm, instances_on_device], dtype=torch.int64)
    tp.broadcast(req)
    blocks, budget, util_ppm, instances = (int(x) for x in req)
    device = torch.device(device)
    if blocks < 0 and budget < 0 and device.type == "cuda" and model is not None:
        blocks = cuda_kv_blocks(local_config(cfg, rank), model, device, None if util_ppm < 0 else util_ppm / 1e6,
                                instances)[0]
    elif blocks < 0:
        blocks = num_blocks_for_budget(local_config(cfg, rank), device, None if budget < 0 else budget)
    return tp.all_reduce_min(blocks)
