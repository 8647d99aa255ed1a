"""The multi-head latent attention part of the Hugging Face -> engine tensor mapping (DeepSeek-V2 /
V3; backend/models/mla.py names the engine tensors), and its tensor-parallel split.

DeepSeek stores the rope part of q (per head, after the nope part) and of kv_a_proj_with_mqa (after
the latent) in interleaved pairs (x0, x1), (x2, x3), ...; the engine's RoPE rotates halves, so
those output rows are reordered to [x0, x2, ... | x1, x3, ...]. q and k get the same order, which
leaves every q . k unchanged; the cache stores the rope key in the new order.
"""
from __future__ import annotations

from typing import Callable, Iterator, Optional, Tuple

import torch

from tritium.backend.config import ModelConfig


def _deinterleave(rope: int) -> torch.Tensor:
    return torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])


def _reorder_q(w: torch.Tensor, m: ModelConfig, interleaved: bool) -> torch.Tensor:
    if not interleaved:
        return w
    d, nope = m.head_dim, m.qk_nope_head_dim
    per_head = torch.cat([torch.arange(nope), nope + _deinterleave(m.qk_rope_head_dim)])
    rows = (torch.arange(m.num_heads)[:, None] * d + per_head[None, :]).reshape(-1)
    return w[rows]


def mla_layer_tensors(m: ModelConfig, fam, i: int, g: Callable[[str, tuple], torch.Tensor]
                      ) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield layer i's attention engine tensors; g(hf_name, shape) reads and shape-checks one."""
    h, rank, rope = m.hidden_size, m.kv_lora_rank, m.qk_rope_head_dim
    qd = m.num_heads * m.head_dim
    p = f"model.layers.{i}.self_attn."
    il = fam.rope_interleaved
    if m.q_lora_rank:
        yield f"layers.{i}.q_a_proj.weight", g(p + "q_a_proj.weight", (m.q_lora_rank, h))
        yield f"layers.{i}.q_a_norm.weight", g(p + "q_a_layernorm.weight", (m.q_lora_rank,))
        yield f"layers.{i}.q_b_proj.weight", _reorder_q(g(p + "q_b_proj.weight", (qd, m.q_lora_rank)), m, il)
    else:
        yield f"layers.{i}.q_proj.weight", _reorder_q(g(p + "q_proj.weight", (qd, h)), m, il)
    kv_a = g(p + "kv_a_proj_with_mqa.weight", (rank + rope, h))
    if il:
        kv_a = kv_a[torch.cat([torch.arange(rank), rank + _deinterleave(rope)])]
    yield f"layers.{i}.kv_a_proj.weight", kv_a
    yield f"layers.{i}.kv_a_norm.weight", g(p + "kv_a_layernorm.weight", (rank,))
    yield f"layers.{i}.kv_b_proj.weight", g(p + "kv_b_proj.weight",
                                            (m.num_heads * (m.qk_nope_head_dim + m.v_head_dim), rank))
    yield f"layers.{i}.o_proj.weight", g(p + "o_proj.weight", (h, m.num_heads * m.v_head_dim))


MLA_PROJECTIONS = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj", "kv_b_proj")


def shard_mla_tensor(name: str, t: torch.Tensor, m: ModelConfig, lay) -> Optional[torch.Tensor]:
    """A rank's part of an MLA engine tensor (builder/tp_shard.py), None if `name` is not one: q_proj
    / q_b_proj rows, kv_b_proj rows and o_proj columns of the rank's heads; q_a_proj, kv_a_proj
    and the norms replicated (every rank computes the same latent and caches it)."""
    parts = name.split(".")
    if not (m.kv_lora_rank and len(parts) == 4 and parts[0] == "layers" and parts[3] == "weight"):
        return None
    lin = parts[2]
    h0, h1 = lay.q_heads
    if lin in ("q_proj", "q_b_proj"):
        return t[h0 * m.head_dim:h1 * m.head_dim]
    if lin == "kv_b_proj":
        per = m.qk_nope_head_dim + m.v_head_dim
        return t[h0 * per:h1 * per]
    if lin == "o_proj":
        return t[:, h0 * m.v_head_dim:h1 * m.v_head_dim]
    if lin in ("q_a_proj", "kv_a_proj", "q_a_norm", "kv_a_norm"):
        return t
    return None


def check_mla_build(m: ModelConfig, opts) -> None:
    """Refuse, before any work, the build options the latent cache cannot honour (naming the flag)."""
    if m.kv_lora_rank and opts.kv_cache_dtype != "auto":
        raise ValueError(f"--kv-cache-dtype {opts.kv_cache_dtype}: the latent cache of multi-head latent attention "
                         f"({m.architecture}) is stored in the engine dtype; allowed: --kv-cache-dtype auto")
