"""DeepSeek-V2 / V3 GGUF files (llama.cpp's architecture `deepseek2`): config keys and the
multi-head latent attention tensors.

llama.cpp's converter (conversion/deepseek.py, DeepseekV2Model) writes both DeepSeek-V2 (and
V2-Lite, without q_lora_rank) and DeepSeek-V3 as `deepseek2`:
- `attention.key_length` / `value_length` are those of the MQA view of the latent
  (kv_lora_rank + rope, kv_lora_rank) and `attention.head_count_kv` is 1; the per-head sizes are
  `attention.key_length_mla` (qk_nope + qk_rope) and `value_length_mla` (v_head_dim), the rope
  part `rope.dimension_count`.
- kv_b_proj is split per head into `attn_k_b` (heads, kv_lora_rank, qk_nope), the k part
  transposed, and `attn_v_b` (heads, v_head_dim, kv_lora_rank); this import joins them back
  (older files hold the unsplit `attn_kv_b`, read as is).
- The rope rows of q and kv_a_proj_with_mqa are stored as in the checkpoint (interleaved pairs:
  llama.cpp runs deepseek2 with its interleaved NORM rope), so the build reorders them as it does
  for the safetensors checkpoint (builder/convert_mla.py).
- Experts stacked as for the other MoE families (builder/gguf_moe.py), shared experts as
  `ffn_*_shexp`, V3's correction bias as `exp_probs_b.bias`, the first
  `leading_dense_block_count` layers dense.

V2 and V3 are told apart by `expert_gating_func` (2 = sigmoid: V3's noaux_tc routing; absent or
1 = softmax: V2's greedy top-k, as llama.cpp's loader assumes when absent). llama.cpp scores a
group by the sum of its two best experts (llama-graph.cpp build_moe_ffn), which is V3's rule;
V2's group_limited_greedy (a group's best expert) has no GGUF spelling, so a softmax file with
expert groups is refused. llama.cpp assumes YaRN's mscale equal to mscale_all_dim (the file keeps
only `rope.scaling.yarn_log_multiplier` = 0.1 * mscale_all_dim), and so does this import.
"""
from __future__ import annotations

from typing import Dict

import torch

from .convert import CheckpointError
from .gguf_meta import f32

# GGUF layer tensor suffix -> HF suffix under model.layers.{i}. (experts and router in gguf_moe.py)
MLA_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight", "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight", "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
}
_SIGMOID, _SOFTMAX = 2, 1  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE


def _kv_b(ts):
    """(attn_k_b (H, rank, nope), attn_v_b (H, v, rank)) -> kv_b_proj (H * (nope + v), rank)."""
    k_b, v_b = ts
    kv = torch.cat([k_b.transpose(1, 2), v_b], dim=1)
    return kv.reshape(-1, kv.shape[-1]).contiguous()


def mla_sources(num_layers: int) -> Dict[str, tuple]:
    """HF kv_b_proj of each layer, joined from the converter's per-head k_b / v_b split (the
    Source tuples of gguf_moe.moe_sources)."""
    return {f"model.layers.{i}.self_attn.kv_b_proj.weight":
            ((f"blk.{i}.attn_k_b.weight", f"blk.{i}.attn_v_b.weight"), _kv_b, False) for i in range(num_layers)}


def deepseek_config(m, cfg: dict, tensors) -> None:
    """Fill the HF config of a `deepseek2` file (DeepSeek-V3 or V2) from GGUF metadata `m`."""
    heads = cfg["num_attention_heads"]
    gating = m.get("expert_gating_func", _SOFTMAX, int)
    if gating not in (_SOFTMAX, _SIGMOID):
        raise CheckpointError(f"{m.path}: metadata deepseek2.expert_gating_func = {gating} is not supported; "
                              f"allowed: 1 (softmax, DeepSeek-V2), 2 (sigmoid, DeepSeek-V3)")
    v3 = gating == _SIGMOID
    if not v3 and any(t.endswith("exp_probs_b.bias") for t in tensors):
        raise CheckpointError(f"{m.path}: tensor exp_probs_b.bias (a routing correction bias) with softmax gating "
                              f"is not supported; allowed: deepseek2.expert_gating_func = 2 (sigmoid)")
    groups, used_groups = m.get("expert_group_count", 1, int), m.get("expert_group_used_count", 1, int)
    if not v3 and groups > 1:
        raise CheckpointError(f"{m.path}: metadata deepseek2.expert_group_count = {groups} with softmax gating is "
                              f"not supported (llama.cpp ranks groups by their two best experts, DeepSeek-V2's "
                              f"group_limited_greedy by the best one); allowed: 1")
    rope = m.req("rope.dimension_count")
    # *_mla: the per-head sizes (files before them hold the per-head sizes in key/value_length)
    qk = m.get("attention.key_length_mla", None, int) or m.req("attention.key_length")
    v_dim = m.get("attention.value_length_mla", None, int) or m.req("attention.value_length")
    if qk <= rope:
        raise CheckpointError(f"{m.path}: metadata deepseek2.attention.key_length_mla = {qk} must exceed "
                              f"rope.dimension_count = {rope}")
    model_type = "deepseek_v3" if v3 else "deepseek_v2"
    cfg.update(model_type=model_type, architectures=["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
               num_key_value_heads=heads, head_dim=rope, qk_rope_head_dim=rope, qk_nope_head_dim=qk - rope,
               qk_head_dim=qk, v_head_dim=v_dim, kv_lora_rank=m.req("attention.kv_lora_rank"),
               q_lora_rank=m.get("attention.q_lora_rank", None, int),
               first_k_dense_replace=m.get("leading_dense_block_count", 0, int),
               norm_topk_prob=bool(m.get("expert_weights_norm", False)),
               routed_scaling_factor=m.get("expert_weights_scale", 1.0, float),
               n_shared_experts=m.get("expert_shared_count", 0, int) or None)
    experts = m.get("expert_count", 0, int)
    if experts:
        cfg.update(n_routed_experts=experts, num_experts_per_tok=m.req("expert_used_count"),
                   moe_intermediate_size=m.req("expert_feed_forward_length"))
    else:  # every layer dense (the converter's non-MoE deepseek2 models)
        cfg.update(n_routed_experts=None, first_k_dense_replace=cfg["num_hidden_layers"])
    if v3:  # llama.cpp's group rule is V3's (see the module docstring)
        cfg.update(topk_method="noaux_tc", scoring_func="sigmoid", n_group=groups, topk_group=used_groups,
                   rope_interleave=True, num_nextn_predict_layers=0)  # the converter drops the MTP layers
    else:
        cfg.update(topk_method="greedy", n_group=None, topk_group=None)
    rp = cfg["rope_parameters"]
    if rp["rope_type"] == "yarn":
        log_mul = m.get("rope.scaling.yarn_log_multiplier", None, float)
        if log_mul is not None:  # written as 0.1 * mscale_all_dim ([TAG_DEEPSEEK2_YARN_LOG_MUL_FIX])
            ms = f32(log_mul / 0.1)
            rp["mscale"] = rp["mscale_all_dim"] = cfg["rope_scaling"]["mscale"] = \
                cfg["rope_scaling"]["mscale_all_dim"] = ms
