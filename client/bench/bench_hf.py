"""`tritium bench --engine DIR --hf-baselines`: offline throughput of the in-flight engine vs HF generate.

A fixed, seeded workload (default 64 requests, prompts of 16-512 random tokens, outputs of
16-256 tokens, greedy, EOS ignored so every system generates exactly the same number of tokens)
runs through:
  1. Tritium's LLMEngine, all requests submitted at once (in-flight batching, paged KV);
  2. HF transformers `generate`, one request at a time;
  3. HF `generate` on static batches of 16 (left padded; a batch runs until its longest output,
     only each request's own tokens count as output).
It prints output tokens/s of each, the ratios, and the fraction of allocated KV memory (blocks in
use x block_size) holding live tokens, averaged over engine steps. With the HF baselines, Tritium
runs once before and once after them and the ratios use its mean speed, so a machine that slows
down or speeds up during the run does not favour either side. transformers is imported only
here, never by the runtime.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time


def make_workload(num_requests, prompt_len, output_len, vocab_size, seed, avoid_ids=()):
    """[(prompt_ids, output_len)]: uniform lengths, random non-special token ids, all from `seed`."""
    for name, (lo, hi) in (("--prompt-len", prompt_len), ("--output-len", output_len)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} needs 1 <= MIN <= MAX, got {lo} {hi}")
    if num_requests < 1:
        raise ValueError(f"--num-requests must be >= 1, got {num_requests}")
    rng = random.Random(seed)
    avoid = set(avoid_ids)
    out = []
    for _ in range(num_requests):
        n = rng.randint(*prompt_len)
        ids = []
        while len(ids) < n:
            t = rng.randrange(min(100, vocab_size - 1), vocab_size)
            if t not in avoid:
                ids.append(t)
        out.append((ids, rng.randint(*output_len)))
    return out


def run_tritium(args, workload):
    """Returns (seconds, output token lists, mean KV live fraction, peak blocks used, stats)."""
    from tritium.backend.engine import LLMEngine
    from tritium.backend.sampling_params import SamplingParams
    engine = LLMEngine(args.engine, num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens, device=args.device)
    # Warm-up (allocator, first-call overheads) on a throwaway request.
    engine.generate(prompt_token_ids=[workload[0][0][:16]], params=SamplingParams(max_tokens=2, temperature=0))
    engine.block_manager.reset_prefix_cache()
    for i, (ids, n) in enumerate(workload):
        engine.add_request(f"b{i}", prompt_token_ids=ids,
                           params=SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    outputs, live_sum, steps, peak = {}, 0.0, 0, 0
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        st = engine.stats()
        if st["kv_blocks_used"]:
            live_sum += st["kv_live_fraction"]
            steps += 1
            peak = max(peak, st["kv_blocks_used"])
    secs = time.perf_counter() - t0
    return secs, [outputs[f"b{i}"] for i in range(len(workload))], live_sum / max(steps, 1), peak, engine.stats()


def hf_source(args):
    if args.hf_model:
        return args.hf_model
    with open(os.path.join(args.engine, "engine.json")) as f:
        src = json.load(f).get("build", {}).get("source")
    if not src or not os.path.exists(src):
        raise ValueError(f"engine build source {src!r} not found; pass --hf-model PATH")
    return src


def load_hf(path, dtype_name, device):
    import warnings

    import torch
    from transformers import AutoModelForCausalLM
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype_name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if path.lower().endswith(".gguf"):
            model = AutoModelForCausalLM.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                                         gguf_file=os.path.basename(path), dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(device).eval()


def run_hf_sequential(model, workload, device, pad_id):
    import torch
    outs = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for ids, n in workload:
            x = torch.tensor([ids], device=device)
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, pad_token_id=pad_id)
            outs.append(y[0, len(ids):].tolist())
    return time.perf_counter() - t0, outs


def run_hf_static(model, workload, batch_size, device, pad_id):
    import torch
    t0 = time.perf_counter()
    with torch.inference_mode():
        for b in range(0, len(workload), batch_size):
            batch = workload[b:b + batch_size]
            width = max(len(ids) for ids, _ in batch)
            x = torch.full((len(batch), width), pad_id, dtype=torch.long)
            mask = torch.zeros_like(x)
            for i, (ids, _) in enumerate(batch):  # left padding, as decoder-only batching requires
                x[i, width - len(ids):] = torch.tensor(ids)
                mask[i, width - len(ids):] = 1
            n = max(m for _, m in batch)
            model.generate(x.to(device), attention_mask=mask.to(device), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=pad_id)
    return time.perf_counter() - t0


def run_hf_baselines(args: argparse.Namespace) -> int:
    import torch
    from tritium.backend.config import EngineConfig
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    cfg = EngineConfig.load(args.engine)
    m = cfg.model
    specials = set(m.eos_token_ids) | {t for t in (m.bos_token_id, m.pad_token_id) if t is not None}
    workload = make_workload(args.num_requests, args.prompt_len, args.output_len, m.vocab_size, args.seed, specials)
    total_out = sum(n for _, n in workload)
    print(f"workload: {len(workload)} requests, prompt tokens {sum(len(p) for p, _ in workload)}, "
          f"output tokens {total_out} (seed {args.seed}); torch threads {torch.get_num_threads()}", flush=True)
    secs, tri_outs, live, peak, st = run_tritium(args, workload)
    res = {"tritium_seconds": secs, "tritium_tok_s": total_out / secs, "kv_live_fraction": live,
           "kv_blocks_peak": peak, "kv_blocks_total": st["kv_blocks_total"], "preemptions": st["preemptions"],
           "output_tokens": total_out, "num_requests": len(workload), "threads": torch.get_num_threads()}
    print(f"tritium        {res['tritium_tok_s']:9.1f} output tok/s  ({secs:.1f} s, {st['num_steps']} steps, "
          f"{st['preemptions']} preemptions)", flush=True)
    print(f"kv live        {100 * live:9.2f} % of allocated KV memory holds live tokens "
          f"(peak {peak}/{st['kv_blocks_total']} blocks)", flush=True)
    if not args.skip_hf:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        model = load_hf(hf_source(args), cfg.dtype, device)
        pad = m.pad_token_id if m.pad_token_id is not None else (m.eos_token_ids or (0,))[0]
        seq_work = workload[:args.hf_sequential_requests] if args.hf_sequential_requests else workload
        seq_secs, hf_outs = run_hf_sequential(model, seq_work, device, pad)
        res["hf_sequential_tok_s"] = sum(n for _, n in seq_work) / seq_secs
        res["hf_sequential_requests"] = len(seq_work)
        same = sum(a == b for a, b in zip(tri_outs, hf_outs))
        print(f"hf sequential  {res['hf_sequential_tok_s']:9.1f} output tok/s  ({seq_secs:.1f} s over "
              f"{len(seq_work)} requests; greedy outputs identical to Tritium for {same}/{len(seq_work)})", flush=True)
        st_secs = run_hf_static(model, workload, args.hf_batch_size, device, pad)
        res["hf_static_tok_s"] = total_out / st_secs
        print(f"hf static-{args.hf_batch_size:<4d} {res['hf_static_tok_s']:9.1f} output tok/s  ({st_secs:.1f} s)",
              flush=True)
        del model
        # Tritium again after the baselines: on a shared machine the speed drifts over the minutes
        # the HF runs take, so the ratios use the mean of Tritium's runs before and after them.
        secs2, tri_outs2, _, _, _ = run_tritium(args, workload)
        res["tritium_seconds_runs"] = [secs, secs2]
        res["tritium_tok_s"] = 2 * total_out / (secs + secs2)
        print(f"tritium again  {total_out / secs2:9.1f} output tok/s  ({secs2:.1f} s; outputs "
              f"{'identical' if tri_outs2 == tri_outs else 'DIFFERENT'}); mean of both runs "
              f"{res['tritium_tok_s']:.1f} tok/s", flush=True)
        res["speedup_vs_hf_sequential"] = res["tritium_tok_s"] / res["hf_sequential_tok_s"]
        res["speedup_vs_hf_static"] = res["tritium_tok_s"] / res["hf_static_tok_s"]
        print(f"ratios         {res['speedup_vs_hf_sequential']:.1f}x HF sequential (target >= 10x), "
              f"{res['speedup_vs_hf_static']:.1f}x HF static-{args.hf_batch_size} (target >= 3x), "
              f"KV live {100 * live:.1f}% (target >= 96%)")
    if args.json:
        print(json.dumps(res, sort_keys=True))
    sys.stdout.flush()
    return 0
