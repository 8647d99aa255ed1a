"""Whole-model mixture-of-experts benchmarks on CPU, random weights, in-process.

    python -m tritium.client.bench.moe_model_bench --workdir DIR [--rounds 3] [--steps 24]
    python -m tritium.client.bench.moe_model_bench --workdir DIR --tp 2

Default mode: MoE vs dense at the same active parameters. A Qwen3-MoE-shaped model (E experts of
width I, top-k) against a dense Qwen3 whose MLP width is k * I, attention, norms, vocabulary and
depth identical, so every token multiplies the same number of weights; greedy decode of B
streams (B = 1 and 16) after a 16-token prompt. Prints ms per decode step (the time of S steps
minus the time of one, over S - 1) and output tokens/s, medians over interleaved rounds, and
the MoE / dense throughput ratio.

--tp N: the MoE model at TP = 1 and TP = N over gloo (experts split by columns, one thread per
rank and a one-thread TP = 1). Also prints, per decode step, the bytes rank 0 sent through
collectives (counted on rank 0's TPGroup: all-reduce, broadcast, logits gather), the bytes an
all-reduce of the MoE output accounts for, and, from the routing of the same run, what a
whole-experts-per-rank layout with data-parallel attention would move through its two
all-to-alls (dispatch + combine; expert e on rank e * N // E, token t at home on rank t % N) and
that layout's load imbalance (the busiest rank's (token, expert) pairs over the mean).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

SHAPE = dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
             vocab_size=4096, max_position_embeddings=1024, tie_word_embeddings=False)
MOE = dict(num_experts=32, num_experts_per_tok=4, moe_intermediate_size=192)


def _checkpoint(kind: str, path: str, args) -> str:
    """A random Hugging Face checkpoint (config.json + safetensors) of the benchmark's shapes."""
    from transformers import AutoConfig, AutoModelForCausalLM
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    moe = dict(MOE, num_experts=args.experts, num_experts_per_tok=args.top_k, moe_intermediate_size=args.moe_width)
    if kind == "moe":
        cfg = AutoConfig.for_model("qwen3_moe", **SHAPE, **moe, intermediate_size=moe["moe_intermediate_size"],
                                   decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    else:
        cfg = AutoConfig.for_model("qwen3", **SHAPE, intermediate_size=args.top_k * args.moe_width)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def _engine(src: str, out: str, dtype: str, tp: int) -> str:
    from tritium.builder.build import BuildOptions, build_engine
    if not os.path.isfile(os.path.join(out, "engine.json")):
        build_engine(BuildOptions(source=src, output=out, dtype=dtype, tensor_parallel_size=tp, progress=False,
                                  eval_tokens=0))
    return out


def _ids(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 4000, (n,), generator=g).tolist()


def _decode(engine, batch: int, steps: int, seed: int, counter=None):
    """Seconds per decode step of `batch` streams (S steps minus one step, over S - 1); with a
    _Counter, also {collective: bytes per decode step} by the same difference."""
    from tritium.backend.sampling_params import SamplingParams
    prompts = [_ids(16, seed + i) for i in range(batch)]

    def run(n):
        before = dict(counter.bytes) if counter else {}
        t = time.perf_counter()
        engine.generate(prompt_token_ids=prompts, params=SamplingParams(max_tokens=n, temperature=0.0,
                                                                        ignore_eos=True))
        return time.perf_counter() - t, {k: v - before.get(k, 0) for k, v in (counter.bytes if counter else {}).items()}
    (t_s, b_s), (t_1, b_1) = run(steps), run(1)
    per_step = {k: (b_s[k] - b_1.get(k, 0)) / (steps - 1) for k in b_s}
    return ((t_s - t_1) / (steps - 1), per_step) if counter else (t_s - t_1) / (steps - 1)


class _Counter:
    """Bytes through rank 0's collectives, and the routing of every MoE call, while installed."""

    def __init__(self):
        from tritium.backend.models.moe import SparseMoE
        from tritium.backend.parallel.comm import TPGroup
        self.bytes, self.routes, self.patched = {}, [], []
        for cls, name in ((TPGroup, "all_reduce"), (TPGroup, "broadcast"), (TPGroup, "gather_logits")):
            orig = getattr(cls, name)

            def wrap(obj, t, *a, _orig=orig, _name=name, **kw):
                self.bytes[_name] = self.bytes.get(_name, 0) + t.numel() * t.element_size()
                return _orig(obj, t, *a, **kw)
            self.patched.append((cls, name, orig))
            setattr(cls, name, wrap)
        orig_sel = SparseMoE.select_experts

        def select(layer, x, _orig=orig_sel):
            out = _orig(layer, x)
            self.routes.append(out[1].cpu())
            return out
        self.patched.append((SparseMoE, "select_experts", orig_sel))
        SparseMoE.select_experts = select

    def remove(self):
        for cls, name, orig in self.patched:
            setattr(cls, name, orig)


def _all_to_all_estimate(routes, n: int, experts: int, hidden: int, elem: int):
    """(bytes per rank per MoE layer call, load imbalance) of expert parallelism with data-parallel
    attention, averaged over the recorded decode-step routings."""
    sent, imb = [], []
    for ids in routes:
        t = ids.shape[0]
        owner = ids * n // experts  # (T, k) rank of each chosen expert
        home = torch.arange(t)[:, None] % n
        remote = 0
        for r in range(n):
            remote += int(((owner == r) & (home != r)).any(1).sum())  # one copy per (token, remote rank)
        sent.append(2 * remote * hidden * elem / n)  # dispatch + combine, per rank on average
        load = torch.bincount(owner.reshape(-1), minlength=n).float()
        imb.append(float(load.max() / load.mean()))
    return statistics.mean(sent), statistics.mean(imb)


def _med(xs):
    return statistics.median(xs)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tritium.client.bench.moe_model_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", required=True, help="where the random checkpoints and engines are kept (reused)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=24, help="decode steps per timing (>= 2)")
    p.add_argument("--experts", type=int, default=MOE["num_experts"])
    p.add_argument("--top-k", type=int, default=MOE["num_experts_per_tok"])
    p.add_argument("--moe-width", type=int, default=MOE["moe_intermediate_size"])
    p.add_argument("--tp", type=int, default=1, help="> 1: MoE at TP=1 vs TP=N over gloo instead of MoE vs dense")
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error("--steps must be >= 2")
    from tritium.backend.engine import LLMEngine
    from tritium.backend.sampling_params import SamplingParams
    torch.set_num_threads(1)
    w = args.workdir
    tag = f"e{args.experts}k{args.top_k}i{args.moe_width}"
    moe_src = _checkpoint("moe", os.path.join(w, f"moe-{tag}-hf"), args)
    if args.tp == 1:
        systems = {"dense": _engine(_checkpoint("dense", os.path.join(w, f"dense-{tag}-hf"), args),
                                    os.path.join(w, f"dense-{tag}-{args.dtype}"), args.dtype, 1),
                   "moe": _engine(moe_src, os.path.join(w, f"moe-{tag}-{args.dtype}"), args.dtype, 1)}
    else:
        systems = {"tp1": _engine(moe_src, os.path.join(w, f"moe-{tag}-{args.dtype}"), args.dtype, 1),
                   f"tp{args.tp}": _engine(moe_src, os.path.join(w, f"moe-{tag}-{args.dtype}-tp{args.tp}"),
                                           args.dtype, args.tp)}
    batches = (1, 16)
    runs = {k: {b: [] for b in batches} for k in systems}
    comm = {b: None for b in batches}
    for r in range(args.rounds):
        for key in (list(systems) if r % 2 == 0 else list(reversed(systems))):
            kw = {"threads_per_rank": 1} if key.startswith("tp") and key != "tp1" else {}
            with LLMEngine(systems[key], device="cpu", num_kv_blocks=512, **kw) as eng:
                eng.generate(prompt_token_ids=[_ids(16, 99)],
                             params=SamplingParams(max_tokens=2, ignore_eos=True))  # warm
                for b in batches:
                    if key != "tp1" and args.tp > 1 and r == 0:
                        c = _Counter()
                        try:
                            _, per_step = _decode(eng, b, args.steps, 7, c)
                            comm[b] = (per_step, [x for x in c.routes if x.shape[0] == b])
                        finally:
                            c.remove()
                    runs[key][b].append(_decode(eng, b, args.steps, 100 * r + b))
            print(f"round {r + 1} {key}: " + ", ".join(f"B={b} {runs[key][b][-1] * 1000:.2f} ms/step"
                                                       for b in batches), flush=True)
    a, bkey = list(systems)
    print(f"\n| batch | {a} ms/step | {bkey} ms/step | {a} tokens/s | {bkey} tokens/s | "
          f"{bkey} / {a} throughput |")
    print("|---|---|---|---|---|---|")
    for b in batches:
        ta, tb = _med(runs[a][b]), _med(runs[bkey][b])
        print(f"| {b} | {ta * 1000:.2f} | {tb * 1000:.2f} | {b / ta:.1f} | {b / tb:.1f} | {ta / tb:.2f} |")
    if args.tp > 1:
        elem = 2 if args.dtype == "bfloat16" else 4
        h, layers = SHAPE["hidden_size"], SHAPE["num_hidden_layers"]
        print(f"\nbytes per decode step (rank 0 of {args.tp}; ring all-reduce moves 2(N-1)/N of the buffer per rank)")
        print("| batch | all-reduce (measured) | broadcast (measured) | logits gather (measured) | "
              "of which MoE outputs | two all-to-alls, EP + DP attention (estimated) | EP load imbalance (max/mean) |")
        print("|---|---|---|---|---|---|---|")
        for b in batches:
            per_step, routes = comm[b]
            moe_ar = layers * b * h * elem
            est, imb = _all_to_all_estimate(routes, args.tp, args.experts, h, elem) if routes else (0.0, 1.0)
            print(f"| {b} | {per_step.get('all_reduce', 0):,.0f} | {per_step.get('broadcast', 0):,.0f} | "
                  f"{per_step.get('gather_logits', 0):,.0f} | {moe_ar:,} | {est * layers:,.0f} | {imb:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
