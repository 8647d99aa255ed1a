"""Batch-1 decode speed of engines (float vs quantized): a benchmark that prints figures.

    python -m tritium.builder.quant_bench ENGINE_DIR [ENGINE_DIR ...] [--tokens 64] [--rounds 3]

Each round runs every engine in turn (interleaved, so load from other processes hits all of
them alike): a 32-token prefill, then --tokens greedy decode steps of one token through the
model's forward with a paged KV cache; only the decode steps are timed. Prints the median
decode tokens/s per engine and its ratio to the first engine.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from tritium.kernels.attention_metadata import AttentionMetadata
from tritium.backend.loader import load_engine

from .quant_eval import kv_cache_dtype


@torch.inference_mode()
def decode_tokens_per_second(model, num_tokens: int, prompt_len: int = 32) -> float:
    """Greedy batch-1 decode of num_tokens after a prompt_len prefill; returns decode tokens/s."""
    m, bs = model.cfg.model, model.cfg.limits.block_size
    total = prompt_len + num_tokens
    nb = (total + bs - 1) // bs
    kv = [(torch.zeros(nb, bs, m.num_kv_heads, m.head_dim, dtype=kv_cache_dtype(model)),
           torch.zeros(nb, bs, m.num_kv_heads, m.head_dim, dtype=kv_cache_dtype(model)))
          for _ in range(m.num_layers)]
    table = [list(range(nb))]
    ids = torch.arange(100, 100 + prompt_len)
    meta = AttentionMetadata.build([prompt_len], [prompt_len], table, bs)
    logits = model.compute_logits(model(ids, torch.arange(prompt_len), kv, meta)[-1:])
    tok = logits.argmax(-1)
    t0 = time.perf_counter()
    for pos in range(prompt_len, total):
        meta = AttentionMetadata.build([1], [pos + 1], table, bs)
        tok = model.compute_logits(model(tok, torch.tensor([pos]), kv, meta)).argmax(-1)
    return num_tokens / (time.perf_counter() - t0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("engines", nargs="+")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    models = [load_engine(e, "cpu")[1] for e in args.engines]
    for mdl in models:
        mdl.pack_for_cpu()  # as the engine's ModelRunner does: oneDNN pre-packed bf16 float linears
    for mdl in models:  # warm-up (packing, allocator)
        decode_tokens_per_second(mdl, 4)
    rates = [[] for _ in models]
    for _ in range(args.rounds):
        for i, mdl in enumerate(models):
            rates[i].append(decode_tokens_per_second(mdl, args.tokens))
    base = statistics.median(rates[0])
    print(f"batch-1 decode, {args.tokens} tokens x {args.rounds} rounds, torch threads {torch.get_num_threads()}")
    for e, mdl, r in zip(args.engines, models, rates):
        med = statistics.median(r)
        cfg = mdl.cfg
        print(f"{med:8.2f} tok/s  {med / base:5.2f}x  {cfg.dtype:9s} {cfg.quantization.method:9s} "
              f"kv={cfg.kv_cache.dtype:5s} {e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
