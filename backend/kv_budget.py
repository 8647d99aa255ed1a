"""KV cache size on CUDA from the gpu_memory_utilization budget (placement.plan_kv_memory), for an
engine and its draft engine, checked against the device's free memory at load."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import placement
from .model_runner import kv_bytes_per_block


def cuda_kv_blocks(cfg, model, device, utilization: Optional[float], instances: int = 1,
                   draft=None, draft_num_kv_blocks: Optional[int] = None) -> Tuple[int, Optional[int]]:
    """(target blocks, draft blocks or None). draft: (draft cfg, draft model), already on the device."""
    dev = torch.device(device)
    _, total = placement.cuda.mem_get_info(dev.index if dev.index is not None else 0)
    util = placement.DEFAULT_GPU_MEMORY_UTILIZATION if utilization is None else utilization
    block = kv_bytes_per_block(cfg)
    d_weights = d_token = 0
    d_block, d_declared = None, None
    if draft is not None:
        dcfg, dmodel = draft
        d_block = kv_bytes_per_block(dcfg)
        d_token, d_weights = d_block // dcfg.limits.block_size, placement.module_bytes(dmodel)
        if draft_num_kv_blocks is not None:
            d_declared = draft_num_kv_blocks * d_block
    plan = placement.plan_kv_memory(total, util, instances, placement.module_bytes(model),
                                    block // cfg.limits.block_size, d_weights, d_token, d_declared)
    placement.check_fits(dev, plan.target_kv_bytes + plan.draft_kv_bytes)
    return plan.target_kv_bytes // block, (plan.draft_kv_bytes // d_block if d_block else None)
