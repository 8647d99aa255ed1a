"""Multi-LoRA benchmark: `python -m tritium.client.bench.lora_bench --engine E [--rank 16] [--reps 3]`.

In-process, on the engine's device with --threads torch threads (default 2). Writes --num-adapters
random PEFT adapters (rank --rank on q/k/v/o/gate/up/down, safetensors as PEFT saves them) for
the engine's model, then prints, every figure a ratio measured in the same run with the
configurations interleaved (the host drifts; a shared, loaded host moves absolute figures):
1. concurrency 16: 16 requests at once (greedy, fixed output length), throughput (generated
   tokens / wall s) of the base model alone (an engine without LoRA), of base-only rows on the
   LoRA engine, and of the adapters mixed round-robin with base rows (the LoRA engine);
2. adapter load time: PEFT folder -> checked host adapter (disk read, checks, fusing), and host
   -> a device slot (the copy into the per-linear stacks), median over the adapters;
3. decode step cost: both engines hold 16 decoding sequences (base rows / the mix) and take one
   step each, alternately, --steps times; the fastest and the median step of each. On a shared,
   loaded host this is the robust figure: the two are timed microseconds apart, and steady-state
   decode throughput at concurrency 16 is 16 / step time.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Dict, List

import torch

from tritium.backend.engine import LLMEngine
from tritium.backend.lora.adapter import part_shapes
from tritium.backend.lora.manager import LoRAConfig
from tritium.backend.sampling_params import SamplingParams

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_adapter(path: str, model_cfg, rank: int, seed: int) -> str:
    """A PEFT LoRA folder (adapter_config.json + adapter_model.safetensors) with random A and B."""
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(seed)
    shapes = part_shapes(model_cfg)
    tensors = {}
    for layer in range(model_cfg.num_layers):
        for part in TARGETS:
            k, n = shapes[part]
            block = "self_attn" if part in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            pre = f"base_model.model.model.layers.{layer}.{block}.{part}"
            tensors[f"{pre}.lora_A.weight"] = torch.randn(rank, k, generator=g) / k ** 0.5
            tensors[f"{pre}.lora_B.weight"] = torch.randn(n, rank, generator=g) * 0.01
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
                   "task_type": "CAUSAL_LM", "bias": "none"}, f)
    return path


def _prompts(tokenizer, vocab: int, n: int, length: int) -> List[List[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(100, vocab - 1, (length,), generator=g).tolist() for _ in range(n)]


def throughput(engine: LLMEngine, prompts, loras, max_tokens: int) -> float:
    engine.block_manager.reset_prefix_cache()  # every configuration prefills cold
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    outs = engine.generate(prompt_token_ids=prompts, params=params, lora_names=loras)
    wall = time.perf_counter() - t
    return sum(len(o.outputs[0].token_ids) for o in outs) / wall


def decode_step_cost(configs: Dict[str, tuple], prompts, steps: int) -> Dict[str, List[float]]:
    """configs: label -> (engine, lora names per prompt). Seconds of each decode step, per label."""
    for label, (eng, loras) in configs.items():
        params = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
        for i, p in enumerate(prompts):
            eng.add_request(f"step-{label}-{i}", prompt_token_ids=p, params=params,
                            lora_name=None if loras is None else loras[i])
        while any(s.num_computed_tokens < s.num_tokens - 1 for s in eng.scheduler.running) or eng.scheduler.waiting:
            eng.step()  # the prefill
    times: Dict[str, List[float]] = {label: [] for label in configs}
    for _ in range(steps):
        for label, (eng, _) in configs.items():
            t = time.perf_counter()
            eng.step()
            times[label].append(time.perf_counter() - t)
    for eng, _ in configs.values():
        for rid in list(eng.requests):
            eng.abort(rid)
        eng.step()
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tritium.client.bench.lora_bench", description=__doc__.split("\n")[0])
    ap.add_argument("--engine", required=True, help="engine directory")
    ap.add_argument("--num-adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40, help="decode steps timed per configuration (part 3)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    tmp = tempfile.mkdtemp(prefix="lora-bench-")
    base = LLMEngine(args.engine, device=args.device, max_num_seqs=args.concurrency)
    m = base.config.model
    paths: Dict[str, str] = {f"ad{i}": write_random_adapter(os.path.join(tmp, f"ad{i}"), m, args.rank, i)
                             for i in range(args.num_adapters)}
    lora = LLMEngine(args.engine, device=args.device, max_num_seqs=args.concurrency,
                     lora=LoRAConfig(paths, max_loras=args.num_adapters, max_lora_rank=args.rank))
    print(f"# LoRA benchmark: {m.architecture}, {m.num_layers} layers, {base.config.dtype}, {args.device}, "
          f"{args.threads} threads; {args.num_adapters} adapters of rank {args.rank} on q/k/v/o/gate/up/down")

    # 2) load times first (cold caches), then 1)
    host, dev = [], []
    for name in paths:
        t = time.perf_counter()
        ad = lora.lora.resolve(name)
        host.append(time.perf_counter() - t)
        t = time.perf_counter()
        lora.lora.begin_single(ad, 1)
        if torch.cuda.is_available() and args.device.startswith("cuda"):
            torch.cuda.synchronize()
        dev.append(time.perf_counter() - t)
        lora.lora.end_step()
    mb = statistics.median(ad.num_bytes for ad in (lora.lora.resolve(n) for n in paths)) / 2 ** 20
    print(f"\n## adapter load time (median of {len(paths)}; {mb:.1f} MiB of fp32 weights each)")
    print("| step | ms |\n|---|---|")
    print(f"| PEFT folder -> host adapter (read, check, fuse q/k/v and gate/up) | {1e3 * statistics.median(host):.1f} |")
    print(f"| host -> device slot | {1e3 * statistics.median(dev):.1f} |", flush=True)

    n = args.concurrency
    prompts = _prompts(base.tokenizer, m.vocab_size, n, args.prompt_tokens)
    names = list(paths)
    mixed = [None if i % (len(names) + 1) == len(names) else names[i % (len(names) + 1)] for i in range(n)]
    configs = {"base alone (no LoRA)": (base, None), "LoRA engine, base rows only": (lora, None),
               f"{len(names)} adapters mixed + base rows": (lora, mixed)}
    res: Dict[str, List[float]] = {}
    throughput(base, prompts[:2], None, 4)  # warm-up
    throughput(lora, prompts[:2], mixed[:2], 4)
    for rep in range(args.reps):
        for label, (eng, loras) in configs.items():
            res.setdefault(label, []).append(throughput(eng, prompts, loras, args.max_tokens))
            print(f"# rep {rep + 1}: {label}: {res[label][-1]:.1f} tok/s", flush=True)
    ref = statistics.median(res["base alone (no LoRA)"])
    print(f"\n## concurrency {n} (prompt {args.prompt_tokens} tokens, {args.max_tokens} generated, greedy; "
          f"generated tokens / wall s, median of {args.reps}; rows of the mix: {', '.join(str(x) for x in mixed)})")
    print("| configuration | tok/s | vs base alone |\n|---|---|---|")
    for label, v in res.items():
        med = statistics.median(v)
        print(f"| {label} | {med:.1f} | {med / ref:.2f}x |")

    steps = decode_step_cost({"base alone (no LoRA)": (base, None),
                              f"{len(names)} adapters mixed + base rows": (lora, mixed)}, prompts, args.steps)
    fast = {label: min(v) for label, v in steps.items()}
    med = {label: statistics.median(v) for label, v in steps.items()}
    b_label = "base alone (no LoRA)"
    print(f"\n## decode step of {n} sequences, the two engines alternating ({args.steps} steps each)")
    print("| configuration | fastest step ms | median step ms | throughput vs base alone (fastest / median) |")
    print("|---|---|---|---|")
    for label in steps:
        print(f"| {label} | {1e3 * fast[label]:.1f} | {1e3 * med[label]:.1f} | "
              f"{fast[b_label] / fast[label]:.2f}x / {med[b_label] / med[label]:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
