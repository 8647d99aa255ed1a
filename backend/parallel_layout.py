"""Which slice of the model each tensor-parallel rank holds (the `tensor_parallel` field of engine.json).

The split follows Megatron-LM (Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter
Language Models Using Model Parallelism", 2019): q/k/v and gate/up are column-parallel (each
rank computes some output features), o and down are row-parallel (each rank holds some input
features and the partial outputs are summed by an all-reduce), and the embedding and LM head
are vocab-parallel (each rank holds a range of vocabulary rows).

Attention heads are split on KV-group boundaries so that every rank's query heads find their
KV heads on the same rank, with the same query-to-KV ratio as the full model:
- num_kv_heads >= N: each rank takes a contiguous run of whole KV groups (a KV head with the
  query heads that read it), as even as possible. When N does not divide num_kv_heads the ranks
  hold different numbers of heads (SmolLM2, 9 query / 3 KV heads, at N = 2: 6 + 3 query heads).
- num_kv_heads < N: each KV head is replicated on N / num_kv_heads ranks, which split its query
  heads; needs N a multiple of num_kv_heads and the group size a multiple of N / num_kv_heads.
Mixture-of-experts layers split every expert (and a shared expert) by its intermediate features
the same way; each rank holds a slice of every expert and the replicated router.
The MLP's intermediate features and the vocabulary are split evenly (in units of the int4 group
size for the row-parallel down projection, int4 or grouped int8 / fp8). Layout entries are half-open [start, end) ranges.
"""
from __future__ import annotations

import dataclasses
from typing import List, Sequence, Tuple


class TensorParallelError(ValueError):
    """A tensor-parallel size this model cannot be split into; the message says why."""


def balanced(total: int, parts: int, unit: int = 1) -> List[Tuple[int, int]]:
    """[start, end) ranges splitting range(total) into `parts` contiguous runs whose lengths are
    multiples of `unit` and differ by at most one unit (earlier ranks get the extra)."""
    if total % unit:
        raise TensorParallelError(f"{total} is not a multiple of {unit}")
    units = total // unit
    if units < parts:
        raise TensorParallelError(f"{total} cannot be split into {parts} parts of at least {unit}")
    base, extra = divmod(units, parts)
    out, start = [], 0
    for r in range(parts):
        n = (base + (r < extra)) * unit
        out.append((start, start + n))
        start += n
    return out


def head_ranges(num_heads: int, num_kv_heads: int, n: int) -> List[Tuple[Tuple[int, int], Tuple[int, int]]]:
    """Per rank ((q_start, q_end), (kv_start, kv_end)): see the module docstring."""
    rep = num_heads // num_kv_heads  # query heads per KV head
    if num_kv_heads >= n:
        return [((a * rep, b * rep), (a, b)) for a, b in balanced(num_kv_heads, n)]
    if n % num_kv_heads:
        raise TensorParallelError(
            f"tensor_parallel_size {n} > num_kv_heads {num_kv_heads} needs a multiple of num_kv_heads "
            f"(each KV head replicated on the same number of ranks)")
    per_kv = n // num_kv_heads
    if rep % per_kv:
        raise TensorParallelError(
            f"tensor_parallel_size {n}: each KV head is replicated on {per_kv} ranks, which must split its "
            f"{rep} query heads evenly; use a tensor_parallel_size that divides {num_heads} and is a "
            f"multiple of {num_kv_heads}, or one <= {num_kv_heads}")
    q_per_rank = rep // per_kv
    return [((r * q_per_rank, (r + 1) * q_per_rank), (r // per_kv, r // per_kv + 1)) for r in range(n)]


@dataclasses.dataclass(frozen=True)
class RankLayout:
    q_heads: Tuple[int, int]
    kv_heads: Tuple[int, int]
    intermediate: int            # local intermediate features (the build chose which ones)
    vocab: Tuple[int, int]
    # Mixture of experts: each expert's (and the shared expert's) intermediate features on this
    # rank: every rank holds every expert, split by columns like a dense MLP (0: no experts).
    moe_intermediate: int = 0
    shared_intermediate: int = 0

    @property
    def num_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]


def plan_layout(model_cfg, n: int, intermediate_unit: int = 1) -> List[RankLayout]:
    """The layout of `n` ranks for a ModelConfig; raises TensorParallelError naming the constraint."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise TensorParallelError(f"tensor_parallel_size must be an integer >= 1, got {n!r}")
    m = model_cfg
    heads = head_ranges(m.num_heads, m.num_kv_heads, n)
    try:
        inter = balanced(m.intermediate_size, n, intermediate_unit)
    except TensorParallelError as e:
        raise TensorParallelError(f"tensor_parallel_size {n}: intermediate_size {m.intermediate_size} "
                                  f"cannot be split in units of {intermediate_unit} (quantization group size): {e}") from None
    vocab = balanced(m.vocab_size, n)
    moe = balanced(m.moe_intermediate_size, n) if m.num_experts else [(0, 0)] * n
    shared = balanced(m.shared_expert_intermediate_size, n) if m.shared_expert_intermediate_size else [(0, 0)] * n
    return [RankLayout(q, kv, b - a, v, e1 - e0, s1 - s0)
            for (q, kv), (a, b), v, (e0, e1), (s0, s1) in zip(heads, inter, vocab, moe, shared)]


def layout_to_dict(layout: Sequence[RankLayout]) -> dict:
    return {"size": len(layout),
            "scheme": "megatron: qkv/gate_up column-parallel, o/down row-parallel (all-reduce), "
                      "embedding/lm_head vocab-parallel (gather); heads split on KV-group boundaries",
            "ranks": [{"q_heads": list(r.q_heads), "kv_heads": list(r.kv_heads), "intermediate": r.intermediate,
                       "vocab": list(r.vocab),
                       **({"moe_intermediate": r.moe_intermediate, "shared_intermediate": r.shared_intermediate}
                          if r.moe_intermediate else {})} for r in layout]}


def layout_from_config(cfg) -> List[RankLayout]:
    """The per-rank layout recorded in an EngineConfig (one full rank when tensor_parallel_size is 1)."""
    n = cfg.tensor_parallel_size
    m = cfg.model
    if n == 1:
        return [RankLayout((0, m.num_heads), (0, m.num_kv_heads), m.intermediate_size, (0, m.vocab_size),
                           m.moe_intermediate_size, m.shared_expert_intermediate_size)]
    ranks = (cfg.tensor_parallel or {}).get("ranks")
    if not isinstance(ranks, list) or len(ranks) != n:
        raise TensorParallelError(f"engine.json: tensor_parallel.ranks must list {n} ranks "
                                  f"(tensor_parallel_size {n})")
    out = []
    for i, r in enumerate(ranks):
        try:
            lay = RankLayout(tuple(r["q_heads"]), tuple(r["kv_heads"]), int(r["intermediate"]), tuple(r["vocab"]),
                             int(r.get("moe_intermediate", 0)), int(r.get("shared_intermediate", 0)))
        except (KeyError, TypeError, ValueError) as e:
            raise TensorParallelError(f"engine.json: tensor_parallel.ranks[{i}] is malformed ({e})") from None
        if lay.num_heads <= 0 or lay.num_kv_heads <= 0 or lay.num_heads % lay.num_kv_heads \
                or lay.intermediate <= 0 or lay.vocab[1] <= lay.vocab[0] \
                or (m.num_experts > 0 and lay.moe_intermediate <= 0) \
                or (m.shared_expert_intermediate_size > 0 and lay.shared_intermediate <= 0):
            raise TensorParallelError(f"engine.json: tensor_parallel.ranks[{i}] = {r} is inconsistent")
        out.append(lay)
    return out


def local_config(cfg, rank: int):
    """The EngineConfig a rank's DecoderLM is built from: its own head, feature and vocab counts."""
    lay = layout_from_config(cfg)[rank]
    m = dataclasses.replace(cfg.model, num_heads=lay.num_heads, num_kv_heads=lay.num_kv_heads,
                            intermediate_size=lay.intermediate, vocab_size=lay.vocab[1] - lay.vocab[0],
                            moe_intermediate_size=lay.moe_intermediate,
                            shared_expert_intermediate_size=lay.shared_intermediate)
    return dataclasses.replace(cfg, model=m)
