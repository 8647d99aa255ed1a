"""Split a built engine's tensors into per-rank tensor-parallel shards (`--tensor-parallel-size N`).

The split (backend/parallel_layout.py) is Megatron-LM's: column-parallel layers (qkv, gate_up)
keep some output rows, row-parallel layers (o, down) keep some input columns, the embedding
and LM head keep a range of vocabulary rows. Quantized tensors move with what they describe:
- int8 / fp8 per-output-channel `scales` (N,) follow the rows they scale; a row-parallel layer
  keeps every output channel, so every rank gets all its scales.
- grouped int8 / fp8 (LayerQuant.group_size set) keep their `scales` / `zeros` (K/G, N) like
  int4's: columns for column-parallel layers, whole groups for row-parallel ones.
- int4 `qweight` (N, K/2) is unpacked, sliced and repacked; `scales` / `zeros` (K/G, N) keep
  their columns for column-parallel layers and their groups (rows) for row-parallel ones. A
  row-parallel rank must hold whole groups: the split of the down projection's inputs is chosen
  group by group (with GPTQ act-order, by `g_idx`: each rank takes the channels of a run of whole
  groups, gate/up keep the matching rows, and `g_idx` is renumbered to the local groups).
- KV-cache `k_scale` / `v_scale` (Hkv,) and `k_offset` / `v_offset` (Hkv, D) follow the KV heads.
- q/k norms over the whole projection (OLMo 2, `qk_norm` "full") follow their heads; per-head
  ones (Qwen3, Gemma 3) are replicated.
- A row-parallel bias (no supported architecture has one) stays on rank 0 only, so the
  all-reduce adds it once.
Mixture-of-experts tensors: each expert and the shared expert split by columns like a dense MLP
(convert_moe.shard_moe_tensor); the router and the shared expert's gate replicated.
Everything else (norm weights, the AWQ head's input scale and mean) is replicated.
"""
from __future__ import annotations

import math
import re
from typing import Dict, List, Optional, Tuple

import torch

from tritium.backend.config import EngineConfig
from tritium.backend.parallel_layout import TensorParallelError, layout_to_dict, plan_layout
from tritium.kernels.quant_layouts import pack_int4, unpack_int4

from .convert_mla import shard_mla_tensor
from .convert_moe import shard_moe_tensor

_LAYER = re.compile(r"^layers\.(\d+)\.(qkv_proj|o_proj|gate_up_proj|down_proj)\.(\w+)$")
_KV = re.compile(r"^layers\.(\d+)\.(k_scale|v_scale|k_offset|v_offset)$")
_VOCAB_ROWS = ("embed_tokens.weight", "embed_tokens.qweight", "embed_tokens.scales", "embed_tokens.zeros",
               "lm_head.weight", "lm_head.qweight", "lm_head.scales", "lm_head.zeros", "head_mean_logits")


def _method(cfg: EngineConfig, name: str) -> str:
    lq = cfg.quantization.layers.get(name)
    return getattr(lq, "method", "none") if lq is not None else "none"


def _grouped(lq) -> bool:
    """int4, or int8 / fp8 with group-wise scales: scales / zeros are (K/G, N)."""
    return lq is not None and (lq.method == "int4" or (lq.method in ("int8", "fp8") and bool(lq.group_size)))


def _select_out(t: torch.Tensor, leaf: str, method: str, rows: torch.Tensor, grouped: bool = False) -> torch.Tensor:
    """Column-parallel: keep output features `rows`."""
    if leaf in ("scales", "zeros") and grouped:
        return t[:, rows]
    if leaf == "g_idx":
        return t
    return t[rows]


def _select_in(t: torch.Tensor, leaf: str, method: str, cols: torch.Tensor, group_size: Optional[int],
               g_idx: Optional[torch.Tensor], rank: int, layer: str, grouped: bool = False) -> torch.Tensor:
    """Row-parallel: keep input features `cols` (sorted)."""
    if leaf == "bias":
        return t if rank == 0 else torch.zeros_like(t)
    if not grouped:
        return t[:, cols] if leaf in ("weight", "qweight") else t
    if leaf == "qweight":
        return pack_int4(unpack_int4(t)[:, cols]) if method == "int4" else t[:, cols]
    full = g_idx.long()[cols] if g_idx is not None else cols // group_size
    kept = torch.unique(full)  # sorted group ids this rank holds
    if leaf in ("scales", "zeros"):
        return t[kept]
    if leaf == "g_idx":
        return torch.searchsorted(kept, full).to(t.dtype)
    raise TensorParallelError(f"{layer}: unexpected {method} tensor {leaf!r}")


def _check_whole_groups(layer: str, cols: torch.Tensor, group_size: int, g_idx: Optional[torch.Tensor],
                        rank: int, n: int) -> None:
    g = g_idx.long()[cols] if g_idx is not None else cols // group_size
    counts = torch.bincount(g)
    bad = [int(i) for i in torch.nonzero(counts).flatten() if counts[i] != group_size]
    if bad:
        raise TensorParallelError(
            f"{layer}: quantization group {bad[0]} (group size {group_size}) would be split between tensor-parallel "
            f"ranks (rank {rank} of {n} holds {int(counts[bad[0]])} of its input channels); pick a "
            f"tensor-parallel size whose per-rank input width is a multiple of the group size")


def _intermediate_unit(cfg: EngineConfig) -> int:
    unit = 1
    for i in range(cfg.model.num_layers):
        lq = cfg.quantization.layers.get(f"layers.{i}.down_proj")
        if _grouped(lq):
            unit = unit * lq.group_size // math.gcd(unit, lq.group_size)
    return unit


def shard_engine_tensors(cfg: EngineConfig, tensors: Dict[str, torch.Tensor], n: int
                         ) -> Tuple[dict, List[Dict[str, torch.Tensor]]]:
    """(engine.json's tensor_parallel dict, one tensor dict per rank). Raises TensorParallelError."""
    m = cfg.model
    layout = plan_layout(m, n, _intermediate_unit(cfg))
    hd, inter = m.head_dim, m.intermediate_size
    shards: List[Dict[str, torch.Tensor]] = [{} for _ in range(n)]
    # Per layer and rank: the intermediate channels (sorted) that the rank holds.
    inter_cols: Dict[int, List[torch.Tensor]] = {}
    for i in range(m.num_layers):
        g_idx = tensors.get(f"layers.{i}.down_proj.g_idx")
        if g_idx is None:
            start = 0
            cols = []
            for lay in layout:
                cols.append(torch.arange(start, start + lay.intermediate))
                start += lay.intermediate
        else:  # act-order: each rank takes the channels of a run of whole groups
            gs = cfg.quantization.layers[f"layers.{i}.down_proj"].group_size
            cols, g0 = [], 0
            for lay in layout:
                g1 = g0 + lay.intermediate // gs
                cols.append(torch.nonzero((g_idx.long() >= g0) & (g_idx.long() < g1)).flatten())
                g0 = g1
        inter_cols[i] = cols
    for name, t in tensors.items():
        mo = _LAYER.match(name)
        kv = _KV.match(name)
        for r, lay in enumerate(layout):
            if (mla := shard_mla_tensor(name, t, m, lay)) is not None:
                out = mla
            elif mo:
                i, lin, leaf = int(mo.group(1)), mo.group(2), mo.group(3)
                layer = f"layers.{i}.{lin}"
                method = _method(cfg, layer)
                lq = cfg.quantization.layers.get(layer)
                grouped = _grouped(lq)
                if lin == "qkv_proj":
                    q0, q1 = lay.q_heads
                    k0, k1 = lay.kv_heads
                    nq, nkv = m.num_heads * hd, m.num_kv_heads * hd
                    rows = torch.cat([torch.arange(q0 * hd, q1 * hd), nq + torch.arange(k0 * hd, k1 * hd),
                                      nq + nkv + torch.arange(k0 * hd, k1 * hd)])
                    out = _select_out(t, leaf, method, rows, grouped)
                elif lin == "gate_up_proj":
                    c = inter_cols[i][r]
                    out = _select_out(t, leaf, method, torch.cat([c, inter + c]), grouped)
                else:
                    if lin == "o_proj":
                        cols = torch.arange(lay.q_heads[0] * hd, lay.q_heads[1] * hd)
                    else:
                        cols = inter_cols[i][r]
                    g_idx = tensors.get(f"{layer}.g_idx")
                    if grouped:
                        _check_whole_groups(layer, cols, lq.group_size, g_idx, r, n)
                    out = _select_in(t, leaf, method, cols, getattr(lq, "group_size", None), g_idx, r, layer,
                                     grouped)
            elif kv:
                out = t[lay.kv_heads[0]:lay.kv_heads[1]]
            elif m.qk_norm == "full" and name.endswith((".q_norm.weight", ".k_norm.weight")):
                # OLMo 2's q/k norms span the whole projection: each rank keeps its heads' part
                # (the runtime sums the squares over the ranks, attention.py).
                h0, h1 = lay.q_heads if name.endswith(".q_norm.weight") else lay.kv_heads
                out = t[h0 * hd:h1 * hd]
            elif name.endswith(".sinks"):  # gpt-oss: one sink logit per query head
                out = t[lay.q_heads[0]:lay.q_heads[1]]
            elif name in _VOCAB_ROWS and name.endswith((".scales", ".zeros")) and t.dim() == 2:
                out = t[:, lay.vocab[0]:lay.vocab[1]]  # grouped embedding: scales / zeros (hidden / G, vocab)
            elif name in _VOCAB_ROWS:
                out = t[lay.vocab[0]:lay.vocab[1]]
            elif (moe := shard_moe_tensor(name, t, layout, r)) is not None:
                out = moe
            else:
                out = t
            shards[r][name] = out.contiguous().clone()
    return layout_to_dict(layout), shards
