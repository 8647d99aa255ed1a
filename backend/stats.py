"""Engine-level statistics: KV block states, queue lengths, preemptions, token counters."""
from __future__ import annotations

from typing import Dict

from .models.moe import expert_token_counts


def kv_live_tokens(engine) -> int:
    """Tokens whose K/V sit in blocks now in use; a block shared by several sequences counts once."""
    bs = engine.block_size
    fill: Dict[int, int] = {}
    for seq in engine.scheduler.running:
        for i, bid in enumerate(seq.block_table):
            n = min(bs, max(seq.num_computed_tokens - i * bs, 0))
            if n > fill.get(bid, 0):
                fill[bid] = n
    return sum(fill.values())


def engine_stats(engine) -> dict:
    """Snapshot of the engine. The integer keys kv_blocks_used / kv_blocks_free / kv_blocks_cached,
    preemptions, num_running and num_waiting are part of the Engine API contract.

    kv_blocks_used: blocks held by a sequence (ref_cnt > 0); kv_blocks_cached: unheld blocks still
    holding a reusable prefix (evicted lazily, LRU); kv_blocks_free: the rest.
    kv_live_fraction: live tokens / (used blocks x block_size), i.e. how much allocated KV memory
    holds real tokens (paging wastes at most the tail of each sequence's last block).
    """
    bm = engine.block_manager
    used, free, cached = bm.usage()
    live = kv_live_tokens(engine)
    sched = engine.scheduler
    out = {
        "kv_blocks_used": used,
        "kv_blocks_free": free,
        "kv_blocks_cached": cached,
        "kv_blocks_total": bm.num_blocks,
        "block_size": engine.block_size,
        "kv_live_tokens": live,
        "kv_live_fraction": live / (used * engine.block_size) if used else 1.0,
        "preemptions": sched.num_preemptions,
        "num_running": len(sched.running),
        "num_waiting": len(sched.waiting),
        "num_requests": len(engine.requests),
        "prefix_cache_hit_tokens": bm.num_prefix_hit_tokens,
        "num_steps": engine.num_steps,
        "num_computed_tokens": engine.num_computed_tokens,
        "num_generated_tokens": engine.num_generated_tokens,
        # Speculative decoding (0 when off): tritium_spec_proposed/accepted_tokens_total.
        "spec_proposed_tokens": 0,
        "spec_accepted_tokens": 0,
    }
    if engine.speculator is not None:
        out.update(engine.speculator.stats())
    # Mixture of experts: tokens routed to each expert, summed over the sparse layers (cumulative).
    per_expert = expert_token_counts(getattr(getattr(engine, "runner", None), "model", None))
    if per_expert is not None:
        out["moe_expert_tokens"] = per_expert
    if getattr(engine, "lora", None) is not None:  # per adapter: requests, prompt / generated tokens
        out["lora"] = {k: dict(v) for k, v in engine.lora.counters.items()}
    return out
