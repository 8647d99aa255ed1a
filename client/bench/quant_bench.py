"""Batch-1 decode speed of engines (float vs quantized): a benchmark that prints figures.

    python -m tritium.client.bench.quant_bench ENGINE_DIR [ENGINE_DIR ...] [--tokens 64] [--rounds 3] [--batch 1]
                                               [--threads N] [--bandwidth-mb 256] [--activation-quant none,int8]

Each round runs every engine in turn (interleaved, so load from other processes hits all of
them alike): a 32-token prefill of each of --batch sequences, then --tokens greedy decode steps
of one token per sequence through the model's forward with a paged KV cache; only the decode
steps are timed. Prints the host first (CPU model, the native kernels' ISA path, cores, memory
bandwidth with the run's threads: client/bench/host_info.py), then the median decode tokens/s (all
sequences) per engine and its ratio to the first engine, the same in tokens per CPU-second of the
process (the fairer figure on a loaded host, with --threads 1), and its single-stream bandwidth limit (read
GB/s / the engine's weight bytes).
--activation-quant lists modes (none: weight-only, int8: W8A8 / W4A8 integer-dot kernels); each
engine then runs once per mode, in the same rounds.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from tritium.kernels.attention_metadata import AttentionMetadata
from tritium.backend.loader import load_engine
from tritium.backend.quant import set_activation_quant

from tritium.builder.quant.quant_eval import kv_cache_dtype


@torch.inference_mode()
def decode_tokens_per_second(model, num_tokens: int, prompt_len: int = 32, batch: int = 1) -> float:
    """Greedy decode of num_tokens per sequence for `batch` sequences after a prompt_len prefill
    of each; returns decode tokens/s summed over the batch."""
    m, bs = model.cfg.model, model.cfg.limits.block_size
    total = prompt_len + num_tokens
    nb = (total + bs - 1) // bs
    kv = [(torch.zeros(nb * batch, bs, m.num_kv_heads, m.head_dim, dtype=kv_cache_dtype(model)),
           torch.zeros(nb * batch, bs, m.num_kv_heads, m.head_dim, dtype=kv_cache_dtype(model)))
          for _ in range(m.num_layers)]
    table = [list(range(b * nb, (b + 1) * nb)) for b in range(batch)]
    ids = torch.cat([torch.arange(100 + b, 100 + b + prompt_len) for b in range(batch)])
    meta = AttentionMetadata.build([prompt_len] * batch, [prompt_len] * batch, table, bs)
    hidden = model(ids, torch.arange(prompt_len).repeat(batch), kv, meta)
    tok = model.compute_logits(hidden[prompt_len - 1::prompt_len]).argmax(-1)
    t0, c0 = time.perf_counter(), time.process_time()
    for pos in range(prompt_len, total):
        meta = AttentionMetadata.build([1] * batch, [pos + 1] * batch, table, bs)
        tok = model.compute_logits(model(tok, torch.full((batch,), pos), kv, meta)).argmax(-1)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    decode_tokens_per_second.per_cpu_second = num_tokens * batch / max(cpu, 1e-9)
    return num_tokens * batch / wall


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("engines", nargs="+")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together (default 1)")
    p.add_argument("--bandwidth-mb", type=int, default=256,
                   help="buffer for the host's memory-bandwidth measurement (default 256 MB; 0 skips it)")
    p.add_argument("--activation-quant", default=None, metavar="MODES",
                   help="comma-separated: none, int8; every engine runs once per mode (default: its own setting)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    modes = args.activation_quant.split(",") if args.activation_quant else [None]
    bad = [m for m in modes if m is not None and m not in ("none", "int8")]
    if bad:
        raise SystemExit(f"--activation-quant: {bad[0]!r} is not one of none, int8")
    runs = [(e, mode) for e in args.engines for mode in modes]
    models = []
    for e, mode in runs:
        mdl = load_engine(e, "cpu")[1]
        if mode is not None:
            set_activation_quant(mdl, mode)
        models.append(mdl)
    for mdl in models:
        mdl.pack_for_cpu()  # as the engine's ModelRunner does: oneDNN pre-packed bf16 float linears
    for mdl in models:  # warm-up (packing, allocator)
        decode_tokens_per_second(mdl, 4)
    rates = [[] for _ in models]
    cpu_rates = [[] for _ in models]  # tokens per CPU-second of this process (a loaded host's fairer figure)
    for _ in range(args.rounds):
        for i, mdl in enumerate(models):
            rates[i].append(decode_tokens_per_second(mdl, args.tokens, batch=args.batch))
            cpu_rates[i].append(decode_tokens_per_second.per_cpu_second)
    cbase = statistics.median(cpu_rates[0])
    base = statistics.median(rates[0])
    from tritium.client.bench import host_info
    host = host_info.host_report(torch.get_num_threads(), args.bandwidth_mb)
    print(host_info.format_host(host))
    print(f"batch-{args.batch} decode, {args.tokens} tokens x {args.rounds} rounds, "
          f"torch threads {torch.get_num_threads()}; limit: one stream's tok/s if every weight byte is read "
          f"once per token at the measured read bandwidth")
    for (e, mode), mdl, r, cr in zip(runs, models, rates, cpu_rates):
        med, cmed = statistics.median(r), statistics.median(cr)
        cfg = mdl.cfg
        nbytes = host_info.engine_weight_bytes(e)
        lim = host_info.bandwidth_limit_tok_s(host["memory"]["read_gbs"], nbytes) if "memory" in host else None
        lim_s = f"limit {lim:6.0f} tok/s ({nbytes / 1e6:4.0f} MB)" if lim else ""
        print(f"{med:8.2f} tok/s  {med / base:5.2f}x  {cmed:8.2f} tok/CPU-s  {cmed / cbase:5.2f}x  {cfg.dtype:9s} {cfg.quantization.method:9s} "
              f"kv={cfg.kv_cache.dtype:5s} act={mode or cfg.activation_quant:4s} {lim_s}  {e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
