"""DeepSeek-V3 / V2 tiny checkpoints for the MLA tests (tests/test_models_mla*.py): the configs
registered in tiny_models.FAMILIES, a random router correction bias, and the checkpoint / engine
fixtures (import the fixtures into a test module to use them)."""
from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import tiny_models

V3 = dict(model_type="deepseek_v3", hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
           num_hidden_layers=3, num_attention_heads=4, vocab_size=1000, max_position_embeddings=256,
           n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, first_k_dense_replace=1,
           n_shared_experts=1, kv_lora_rank=40, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16,
           v_head_dim=32, routed_scaling_factor=2.5, tie_word_embeddings=False)
V2 = dict(model_type="deepseek_v2", hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
           num_hidden_layers=2, num_attention_heads=4, vocab_size=1000, max_position_embeddings=256,
           n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1, n_shared_experts=2,
           kv_lora_rank=40, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=32,
           routed_scaling_factor=1.5, tie_word_embeddings=False)
tiny_models.FAMILIES.update({
    # V3: q_lora_rank set, a dense first layer, 1 shared expert, sigmoid scores with a correction
    # bias (set below), top-3 among the 2 best of 4 groups, routed_scaling_factor 2.5
    "deepseek_v3": V3,
    # ... with YaRN (factor 4, mscale != mscale_all_dim: attention factor and softmax-scale correction)
    "deepseek_v3_yarn": dict(V3, rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                                       original_max_position_embeddings=64, beta_fast=32,
                                                       beta_slow=1, mscale=1.0, mscale_all_dim=0.8)),
    # V2-Lite's layout: q_proj (no q_lora_rank), softmax greedy top-2, 2 shared experts
    "deepseek_v2": V2,
    # V2's group_limited_greedy: top-2 among the 2 best of 4 groups (by their best expert)
    "deepseek_v2_grouped": dict(V2, topk_method="group_limited_greedy", n_group=4, topk_group=2),
})
FAMILIES = ["deepseek_v3", "deepseek_v3_yarn", "deepseek_v2", "deepseek_v2_grouped"]


def with_bias(path: str) -> str:
    """transformers initializes e_score_correction_bias to zeros; a random one makes the choice
    differ from the weights (set in the checkpoint itself, so both sides read it)."""
    f = os.path.join(path, "model.safetensors")
    t = load_file(f)
    names = [k for k in t if k.endswith("e_score_correction_bias")]
    if names and all(not t[k].any() for k in names):
        g = torch.Generator().manual_seed(3)
        for k in names:
            t[k] = torch.randn(t[k].shape, generator=g) * 0.3
        save_file(t, f, metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def ds_checkpoint(tiny_checkpoint):
    return lambda family, **over: with_bias(tiny_checkpoint(family, **over))


@pytest.fixture(scope="module")
def ds_engine(ds_checkpoint, tiny_engine):
    def make(family, dtype="float32", **kw):
        ds_checkpoint(family)  # the bias in place before the (cached) build reads the checkpoint
        return tiny_engine(family, dtype, **kw)
    return make
