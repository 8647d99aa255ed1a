"""tensorrtllm_backend's per-request LoRA tensors (`lora_weights` + `lora_config`) -> an adapter.

As TensorRT-LLM's `hf_lora_convert.py` writes them (batch dimension removed):
    lora_config  (num_modules, 3) int32: [module_id, layer_idx, adapter_size]
    lora_weights (num_modules, row_size) float16 / float32: row i = A.flatten() ++ B.flatten(),
        A (adapter_size, in_features), B (out_features, adapter_size) with alpha / r already
        folded into B, zero-padded to the longest row.
Module ids (TensorRT-LLM LoraModule): 0 attn_qkv, 1 attn_q, 2 attn_k, 3 attn_v, 4 attn_dense
(o_proj), 5 mlp_h_to_4h (gate_proj), 6 mlp_4h_to_h (down_proj), 7 mlp_gate (up_proj).
"""
from __future__ import annotations

from typing import Dict, Tuple

import numpy as np
import torch

from .adapter import LoRAAdapter, PartWeights, make_adapter, part_shapes

MODULE_IDS = {1: "q_proj", 2: "k_proj", 3: "v_proj", 4: "o_proj", 5: "gate_proj", 6: "down_proj", 7: "up_proj"}
ATTN_QKV = 0
SUPPORTED_IDS = "0 attn_qkv, 1 attn_q, 2 attn_k, 3 attn_v, 4 attn_dense, 5 mlp_h_to_4h, 6 mlp_4h_to_h, 7 mlp_gate"


def _squeeze_batch(name: str, a: np.ndarray, ndim: int) -> np.ndarray:
    a = np.asarray(a)
    while a.ndim > ndim and a.shape[0] == 1:
        a = a[0]
    if a.ndim != ndim:
        raise ValueError(f"{name} must have shape {'(num_modules, 3)' if ndim == 2 and name == 'lora_config' else '(num_modules, row_size)'} "
                         f"per request, got {tuple(np.asarray(a).shape)}")
    return a


def adapter_from_trtllm(key: str, weights: np.ndarray, config: np.ndarray, model_cfg,
                        max_lora_rank: int) -> LoRAAdapter:
    """Check and map tensorrtllm_backend's LoRA tensors; ValueError names the tensor and the row."""
    config = _squeeze_batch("lora_config", config, 2)
    weights = _squeeze_batch("lora_weights", weights, 2)
    if config.dtype.kind not in "iu" or config.shape[1] != 3:
        raise ValueError(f"lora_config must be an integer tensor (num_modules, 3) of [module_id, layer_idx, "
                         f"adapter_size], got {config.dtype} {tuple(config.shape)}")
    if weights.dtype not in (np.float16, np.float32):
        raise ValueError(f"lora_weights must be TYPE_FP16 or TYPE_FP32, got {weights.dtype}")
    if weights.shape[0] != config.shape[0]:
        raise ValueError(f"lora_weights has {weights.shape[0]} rows, lora_config {config.shape[0]}: one row per module")
    shapes = part_shapes(model_cfg)
    parts: Dict[Tuple[int, str], PartWeights] = {}
    for i, (module_id, layer, r) in enumerate(config.tolist()):
        if module_id != ATTN_QKV and module_id not in MODULE_IDS:
            raise ValueError(f"lora_config row {i}: module_id {module_id} is not supported; supported: {SUPPORTED_IDS}")
        if r < 1:
            raise ValueError(f"lora_config row {i}: adapter_size must be >= 1, got {r}")
        names = ("q_proj", "k_proj", "v_proj") if module_id == ATTN_QKV else (MODULE_IDS[module_id],)
        k = shapes[names[0]][0]
        n = sum(shapes[p][1] for p in names)
        need = r * k + n * r
        if need > weights.shape[1]:
            raise ValueError(f"lora_weights row {i} has {weights.shape[1]} values; module {module_id} of layer "
                             f"{layer} at adapter_size {r} needs {need} ({r} x {k} A + {n} x {r} B)")
        row = torch.from_numpy(np.ascontiguousarray(weights[i, :need], dtype=np.float32))
        a, b = row[:r * k].view(r, k), row[r * k:].view(n, r)
        row0 = 0
        for p in names:  # attn_qkv: one A shared by q, k and v; B split by output rows
            rows = shapes[p][1]
            if (layer, p) in parts:
                raise ValueError(f"lora_config row {i}: layer {layer} {p} is given twice")
            parts[(layer, p)] = PartWeights(a, b[row0:row0 + rows], 1.0)
            row0 += rows
    return make_adapter(key, "request (lora_weights / lora_config)", model_cfg, parts, max_lora_rank)
