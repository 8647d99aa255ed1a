"""num_blocks_for_budget on CUDA without a planned budget: the default gpu_memory_utilization share
of the whole device less what the process holds, capped by free memory (CUDA calls stubbed)."""
from __future__ import annotations

import torch

from tritium.backend import model_runner
from tritium.backend.config import EngineConfig, ModelConfig
from tritium.backend.placement import DEFAULT_GPU_MEMORY_UTILIZATION


def _cfg():
    return EngineConfig(model=ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=32,
                                          intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                          head_dim=8, rms_norm_eps=1e-6, max_position_embeddings=128))


def test_cuda_default_budget_is_a_share_of_the_device(monkeypatch):
    cfg = _cfg()
    block = model_runner.kv_bytes_per_block(cfg)
    total, held = 1000 * block, 200 * block
    free = total - held
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: held)
    n = model_runner.num_blocks_for_budget(cfg, torch.device("cuda", 0), None)
    assert n == int(total * DEFAULT_GPU_MEMORY_UTILIZATION - held) // block  # 650, not 85% of free (680)
    # a second instance already took most of the device: only what is free
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 * block, total))
    assert model_runner.num_blocks_for_budget(cfg, torch.device("cuda", 0), None) == 100
