"""LoRA under tensor parallelism: each rank's part of an adapter, and rank 0's slot loads sent
to the workers.

An adapter is sharded like the base linear it adapts (Megatron-LM's split, parallel_layout.py):
- column-parallel qkv_proj / gate_up_proj: the rank computes some output features, so B keeps
  those rows and A (rank x in) is replicated; the rank's delta is exactly its features' delta.
- row-parallel o_proj / down_proj: the rank holds some input features, so A keeps those columns
  and B is replicated; the rank adds B (A_r x_r) to its partial output before the layer's
  all-reduce, which sums sum_r B A_r x_r = B A x: the delta is counted once.

Only rank 0 has a scheduler and the adapters' caches. When it copies an adapter into a device
slot it broadcasts OP_LORA_LOAD (the slot, a table of modules and their full fused float32 A and
B) before the step, and each step carries the rows' slots; a worker keeps the same slots, cut
to its own part. Adapters added at run time, or sent with a request (lora_task_id), reach the
workers the same way. Plain integers and floats only: nothing is pickled.
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch

from ..parallel_layout import layout_from_config
from .adapter import FUSED_PARTS, module_names, part_shapes

LINEARS = module_names()  # the table's linear index -> name


def lora_shard(cfg, rank: int, model=None) -> Dict[str, Tuple[str, torch.Tensor]]:
    """Rank `rank`'s part of each adapted linear (see the module docstring), as the builder
    splits the base weights (builder/tp_shard.py). ValueError where the split cannot be known
    at run time (a GPTQ act-order down projection splits its inputs by the full g_idx)."""
    m = cfg.model
    layout = layout_from_config(cfg)
    lay = layout[rank]
    for i, layer in enumerate(model.layers if model is not None else ()):
        down = getattr(layer, "down_proj", None)
        if getattr(getattr(down, "base", down), "g_idx", None) is not None:
            raise ValueError(f"LoRA adapters with tensor parallelism are not supported on a GPTQ act-order base "
                             f"(layers.{i}.down_proj has a g_idx): its inputs are split by quantization groups")
    hd, nq, nkv = m.head_dim, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    (q0, q1), (k0, k1) = lay.q_heads, lay.kv_heads
    c0 = sum(r.intermediate for r in layout[:rank])
    inter = torch.arange(c0, c0 + lay.intermediate)
    return {"qkv_proj": ("out", torch.cat([torch.arange(q0 * hd, q1 * hd), nq + torch.arange(k0 * hd, k1 * hd),
                                            nq + nkv + torch.arange(k0 * hd, k1 * hd)])),
            "gate_up_proj": ("out", torch.cat([inter, m.intermediate_size + inter])),
            "o_proj": ("in", torch.arange(q0 * hd, q1 * hd)),
            "down_proj": ("in", inter)}


def pack_load(adapter) -> Tuple[torch.Tensor, torch.Tensor]:
    """An adapter's modules -> (int64 table (M, 3) of [layer, linear index, rank], float32 values:
    each module's A (R, in) then B (out, R), flattened, in table order)."""
    keys = sorted(adapter.modules)
    table = torch.tensor([[layer, LINEARS.index(name), adapter.modules[(layer, name)][0].shape[0]]
                          for layer, name in keys], dtype=torch.int64).reshape(-1, 3)
    values = torch.cat([t.float().reshape(-1) for key in keys for t in adapter.modules[key]])
    return table, values


def unpack_load(model_cfg, table: torch.Tensor, values: torch.Tensor):
    """The inverse of pack_load: {(layer, name): (A, B)} at full size; ValueError on a bad table."""
    shapes = part_shapes(model_cfg)
    out, i = {}, 0
    for layer, li, r in table.tolist():
        name = LINEARS[li]
        parts = FUSED_PARTS[name]
        k, n = shapes[parts[0]][0], sum(shapes[p][1] for p in parts)
        a = values[i:i + r * k].view(r, k)
        b = values[i + r * k:i + r * k + n * r].view(n, r)
        i += r * k + n * r
        out[(layer, name)] = (a, b)
    if i != values.numel():
        raise ValueError(f"LoRA slot load: {values.numel()} values for a table that needs {i}")
    return out
