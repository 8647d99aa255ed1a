"""Mixture-of-experts GGUF files (llama.cpp's converter): config keys and expert tensors.

llama.cpp stacks each layer's experts into one tensor per projection, `blk.{i}.ffn_gate_exps`,
`ffn_up_exps` (E, I, hidden) and `ffn_down_exps` (E, hidden, I), the router as
`blk.{i}.ffn_gate_inp`. The HF checkpoints of Mixtral (GGUF arch `llama` with an expert count),
Qwen3-MoE (`qwen3moe`) and OLMoE (`olmoe`) hold one matrix per expert, so each HF expert name is
served as a slice of the stacked tensor. gpt-oss (`gpt-oss`) is stacked on both sides but
transposed, with gate and up interleaved in one `gate_up_proj` (E, hidden, 2I) and its bias
(conversion/gpt_oss.py splits them): those HF tensors are rebuilt from the two GGUF ones. Its
MXFP4 experts (what the converter writes from OpenAI's MXFP4 checkpoint) are repacked losslessly
into HF's MXFP4 blocks and scales, so the engine keeps them MXFP4.

What the converter does not write, llama.cpp's loader assumes (src/models/*.cpp, llama-graph.cpp),
and so does this import: Qwen3-MoE and Mixtral renormalize their top-k weights (build_moe_ffn
norm_w = true; transformers' Mixtral always does), OLMoE does not (norm_w = false); gpt-oss's clamped SwiGLU uses alpha 1.702 and limit 7.0, slides on every other layer from the
first (load_swa_pattern(ml, 2)), and its YaRN ramp is not truncated (transformers' and OpenAI's
`truncate: false`).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import torch

from .convert import CheckpointError

# HF model_type -> (module holding router and experts, the expert's gate / up / down names)
_PER_EXPERT = {"mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
               "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
               "olmoe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
               "deepseek_v3": ("mlp", ("gate_proj", "up_proj", "down_proj")),
               "deepseek_v2": ("mlp", ("gate_proj", "up_proj", "down_proj"))}
# An HF tensor assembled from GGUF tensors: (their GGUF names, tensors as read -> the HF tensor,
# whether they are read as stored bytes rather than dequantized)
Source = Tuple[Tuple[str, ...], Callable[[List[torch.Tensor]], torch.Tensor], bool]
GGML_MXFP4_BLOCK_BYTES = 17  # block_mxfp4: one E8M0 byte, then 16 bytes of 32 E2M1 codes


def mxfp4_from_ggml(raw: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """ggml MXFP4 rows (..., N, (K / 32) * 17) uint8 -> Hugging Face's (blocks (..., N, K / 32, 16),
    scales (..., N, K / 32)). A ggml block is its E8M0 byte, then 16 bytes whose low nibbles are
    elements 0-15 and high nibbles 16-31 (ggml's dequantize_row_mxfp4); HF packs elements 2j and
    2j + 1 into byte j (low, high). The codes and the scale byte are kept: a lossless repack."""
    blk = raw.reshape(*raw.shape[:-1], -1, GGML_MXFP4_BLOCK_BYTES)
    scales, qs = blk[..., 0], blk[..., 1:]
    codes = torch.cat([qs & 0xF, qs >> 4], dim=-1)  # (..., 32) in element order
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous(), scales.contiguous()


def _interleave(a: torch.Tensor, b: torch.Tensor, dim: int) -> torch.Tensor:
    """[a0, b0, a1, b1, ...] along `dim` (the inverse of the converter's [..., ::2] / [..., 1::2])."""
    return torch.stack([a, b], dim=dim + 1).flatten(dim, dim + 1)


def moe_sources(model_type: str, num_layers: int, num_experts: int, mxfp4: bool = False) -> Dict[str, Source]:
    """HF tensor name -> its Source, for the expert and router tensors of an MoE GGUF file.
    mxfp4: gpt-oss's experts are MXFP4 in the file and are served as HF's `*_blocks` / `*_scales`
    (the engine keeps them MXFP4, as from OpenAI's safetensors)."""
    out: Dict[str, Source] = {}
    for i in range(num_layers):
        b = f"blk.{i}."
        p = f"model.layers.{i}."
        if model_type == "gpt_oss":
            def one(name):
                return (name,), lambda ts: ts[0], False
            out[p + "self_attn.sinks"] = one(b + "attn_sinks.weight")
            out[p + "mlp.router.weight"] = one(b + "ffn_gate_inp.weight")
            out[p + "mlp.router.bias"] = one(b + "ffn_gate_inp.bias")
            x = p + "mlp.experts."
            # (E, I, hidden) gate and up -> (E, hidden, 2I) with gate / up interleaved columns
            gate_up = (b + "ffn_gate_exps.weight", b + "ffn_up_exps.weight")
            if mxfp4:  # kept as stored: HF's MXFP4 names, the rows of gate and up interleaved
                for part, j in (("blocks", 0), ("scales", 1)):
                    out[f"{x}gate_up_proj_{part}"] = (gate_up, lambda ts, j=j: _interleave(
                        mxfp4_from_ggml(ts[0])[j], mxfp4_from_ggml(ts[1])[j], 1), True)
                    out[f"{x}down_proj_{part}"] = ((b + "ffn_down_exps.weight",),
                                                   lambda ts, j=j: mxfp4_from_ggml(ts[0])[j], True)
            else:  # (E, I, hidden) gate and up -> (E, hidden, 2I) with gate / up interleaved columns
                out[x + "gate_up_proj"] = (gate_up, lambda ts: _interleave(ts[0], ts[1], 1).transpose(1, 2).contiguous(),
                                           False)
                out[x + "down_proj"] = ((b + "ffn_down_exps.weight",), lambda ts: ts[0].transpose(1, 2).contiguous(),
                                        False)
            out[x + "gate_up_proj_bias"] = ((b + "ffn_gate_exps.bias", b + "ffn_up_exps.bias"),
                                            lambda ts: _interleave(ts[0], ts[1], 1), False)
            out[x + "down_proj_bias"] = ((b + "ffn_down_exps.bias",), lambda ts: ts[0], False)
            continue
        block, names = _PER_EXPERT[model_type]
        out[f"{p}{block}.gate.weight"] = ((b + "ffn_gate_inp.weight",), lambda ts: ts[0], False)
        for hf, g in zip(names, ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")):
            for e in range(num_experts):
                out[f"{p}{block}.experts.{e}.{hf}.weight"] = ((f"{b}{g}.weight",), lambda ts, e=e: ts[0][e], False)
    return out


def moe_config(m, cfg: dict, model_type: str) -> None:
    """Fill the HF config keys of an MoE model from GGUF metadata `m` (builder/gguf_meta.Meta)."""
    experts, used = m.req("expert_count"), m.req("expert_used_count")
    cfg["num_experts_per_tok"] = used
    cfg["num_local_experts"] = cfg["num_experts"] = experts  # transformers' two spellings
    shared = m.get("expert_shared_count", 0, int)
    if shared:
        raise CheckpointError(f"{m.path}: metadata {m.arch}.expert_shared_count = {shared} is not supported for "
                              f"{m.arch}; allowed: 0")
    if model_type == "qwen3_moe":
        cfg["moe_intermediate_size"] = m.req("expert_feed_forward_length")
        cfg.update(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    elif model_type == "olmoe":
        cfg.update(norm_topk_prob=False, clip_qkv=None)
    elif model_type == "gpt_oss":
        cfg["intermediate_size"] = m.req("expert_feed_forward_length")
        cfg.update(swiglu_limit=7.0, swiglu_alpha=1.702, hidden_act="silu")
