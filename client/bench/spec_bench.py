"""Speculative decoding benchmark: `python -m tritium.client.bench.spec_bench --engine E [--draft-engine D]`.

In-process, on the engine's device with --threads torch threads (default 2). Every figure is a
ratio against plain decoding measured in the same run, runs interleaved (the host drifts):
1. single stream, one request at a time, greedy: decode speed (output tokens after the first
   / time from the first to the last token) with n-gram lookup and with the draft engine,
   on input-grounded tasks (summarise, edit, extract from a given text) and on open chat;
   acceptance rate (accepted / proposed tokens) and whether the output equals plain decoding;
2. concurrency 16: 16 requests at once (mixed tasks), throughput (generated tokens / wall time)
   with speculation against plain decoding;
Configurations: "ngram" / "draft" use the switch-off rule (the default), "ngram!" / "draft!"
never switch off.
3. the switch-off rule's constant: plain step time for B = 1 and B = 16 decodes, fitted to
   a + b * B; prints r = a / b (SpeculativeConfig.step_overhead_tokens).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Dict, List

from tritium.backend.engine import LLMEngine
from tritium.backend.sampling_params import SamplingParams
from tritium.backend.speculative.config import SpeculativeConfig
from tritium.backend.speculative.speculator import Speculator, make_speculator


def _prose() -> List[str]:
    with open(os.path.join(os.path.dirname(__file__), "bench_prose.txt"), encoding="utf-8") as f:
        return [p.strip() for p in f.read().split("\n") if p.strip()]


def _chat(user: str) -> str:
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def tasks() -> Dict[str, List[str]]:
    """name -> prompts. 'grounded' tasks answer from a text given in the prompt; 'chat' is open."""
    p = _prose()
    typo = p[1].replace("the ", "teh ", 3).replace("and", "adn", 2)
    return {
        "summarise": [_chat(f"Summarise this text in three sentences.\n\n{p[0]}"),
                      _chat(f"Summarise this text.\n\n{p[7]}")],
        "edit": [_chat(f"Fix the spelling mistakes in this text and return the corrected text.\n\n{typo}"),
                 _chat(f"Rewrite this text in the present tense.\n\n{p[2]}")],
        "extract": [_chat(f"List every object and tool mentioned in this text, one per line.\n\n{p[3]}"),
                    _chat(f"Quote the sentences of this text that mention the town.\n\n{p[4]}")],
        "chat": [_chat("Write a short poem about the sea."),
                 _chat("What are three tips for learning a new language?")],
    }


GROUNDED = ("summarise", "edit", "extract")


def run_one(engine: LLMEngine, prompt: str, max_tokens: int):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    (out,) = engine.generate([prompt], params)
    m = out.metrics
    n = m["num_output_tokens"]
    decode_s = m["last_token_time"] - m["first_token_time"]
    return out.outputs[0].token_ids, (n - 1) / decode_s if n > 1 and decode_s > 0 else float("nan")


def single_stream(engine, speculators: Dict[str, object], reps: int, max_tokens: int) -> None:
    print(f"\n## single stream (greedy, max_tokens {max_tokens}, {reps} interleaved reps; decode tok/s median)")
    print("| task | prompt | plain tok/s | " + " | ".join(f"{n} tok/s | {n} speedup | {n} accept | {n} same"
                                                     for n in speculators) + " |")
    print("|---" * (3 + 4 * len(speculators)) + "|")
    summary: Dict[str, Dict[str, List[float]]] = {}
    for task, prompts in tasks().items():
        for pi, prompt in enumerate(prompts):
            speeds: Dict[str, List[float]] = {"plain": []}
            acc: Dict[str, List[int]] = {}
            same: Dict[str, bool] = {}
            ref = None
            for _ in range(reps):
                engine.speculator = None
                ids, tps = run_one(engine, prompt, max_tokens)
                ref = ids
                speeds["plain"].append(tps)
                for name, spec in speculators.items():
                    engine.speculator = spec
                    p0, a0 = spec.num_proposed, spec.num_accepted
                    ids, tps = run_one(engine, prompt, max_tokens)
                    speeds.setdefault(name, []).append(tps)
                    acc.setdefault(name, [0, 0])
                    acc[name][0] += spec.num_proposed - p0
                    acc[name][1] += spec.num_accepted - a0
                    same[name] = same.get(name, True) and ids == ref
            engine.speculator = None
            plain = statistics.median(speeds["plain"])
            cells = [task, str(pi), f"{plain:.1f}"]
            for name in speculators:
                v = statistics.median(speeds[name])
                prop, ok = acc[name]
                summary.setdefault(name, {}).setdefault("grounded" if task in GROUNDED else "chat", []).append(v / plain)
                cells += [f"{v:.1f}", f"{v / plain:.2f}x", f"{ok / prop:.0%}" if prop else "-",
                          "yes" if same[name] else "no"]
            print("| " + " | ".join(cells) + " |", flush=True)
    print()
    for name, groups in summary.items():
        for g, ratios in groups.items():
            print(f"{name}: {g} speedup geometric mean {statistics.geometric_mean(ratios):.2f}x over {len(ratios)} prompts")


def concurrency(engine, speculators: Dict[str, object], reps: int, max_tokens: int, n: int = 16) -> None:
    allp = [p for ps in tasks().values() for p in ps]
    prompts = [allp[i % len(allp)] for i in range(n)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    print(f"\n## concurrency {n} (greedy, max_tokens {max_tokens}; generated tokens / wall s, median of {reps})")
    res: Dict[str, List[float]] = {}
    for _ in range(reps):
        for name, spec in [("plain", None)] + list(speculators.items()):
            engine.speculator = spec
            engine.block_manager.reset_prefix_cache()  # every configuration prefills cold
            t = time.perf_counter()
            outs = engine.generate(prompts, params)
            wall = time.perf_counter() - t
            res.setdefault(name, []).append(sum(len(o.outputs[0].token_ids) for o in outs) / wall)
    engine.speculator = None
    plain = statistics.median(res["plain"])
    print("| config | tok/s | vs plain |\n|---|---|---|")
    for name, v in res.items():
        m = statistics.median(v)
        print(f"| {name} | {m:.1f} | {m / plain - 1:+.1%} |")


def step_cost(engine, reps: int) -> None:
    """Plain decode step time with B sequences (B = 1, 16) -> r = a / b of step(B) = a + b B."""
    import torch
    from tritium.backend.scheduler import SchedulerOutput
    engine.speculator = None
    prompt = [100 + i for i in range(200)]
    for i in range(16):
        engine.add_request(f"cost{i}", prompt_token_ids=[t + i for t in prompt],
                           params=SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
    while any(s.num_output_tokens == 0 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    seqs = list(engine.scheduler.running)

    def time_step(b):
        sched = SchedulerOutput(seqs=seqs[:b], num_new_tokens=[1] * b)
        t = time.perf_counter()
        with torch.inference_mode():
            engine.runner.run(sched)  # recomputes the last token's K/V in place: the cache is unchanged
        return time.perf_counter() - t
    t1, t16 = [], []
    for _ in range(reps * 5):
        t1.append(time_step(1))
        t16.append(time_step(16))
    for i in range(16):
        engine.abort(f"cost{i}")
    engine.step()
    a1, a16 = statistics.median(t1), statistics.median(t16)
    b = (a16 - a1) / 15
    a = a1 - b
    print(f"\n## step cost (plain decode steps, median of {reps * 5})\nB=1: {a1 * 1e3:.1f} ms, B=16: {a16 * 1e3:.1f} ms"
          f" -> a = {a * 1e3:.1f} ms, b = {b * 1e3:.2f} ms/token, r = a/b = {a / b:.1f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tritium.client.bench.spec_bench", description=__doc__.split("\n")[0])
    ap.add_argument("--engine", required=True, help="target engine directory")
    ap.add_argument("--draft-engine", default=None, help="draft engine (e.g. the int4 build of the same model)")
    ap.add_argument("--num-speculative-tokens", type=int, default=4, help="k of the n-gram lookup (default 4)")
    ap.add_argument("--draft-k", type=int, default=None, help="k of the draft engine (default: the same)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens per request (default 128)")
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions (default 3)")
    ap.add_argument("--skip", default="", help="comma-separated sections to skip: single,c16,cost")
    args = ap.parse_args(argv)
    import torch
    torch.set_num_threads(args.threads)
    k = args.num_speculative_tokens
    engine = LLMEngine(args.engine, num_kv_blocks=1024, max_num_seqs=32)
    # "X" uses the switch-off rule (the default), "X!" never switches off (step_overhead_tokens inf).
    always = float("inf")
    speculators = {"ngram": Speculator(SpeculativeConfig("ngram", num_speculative_tokens=k)),
                   "ngram!": Speculator(SpeculativeConfig("ngram", num_speculative_tokens=k, step_overhead_tokens=always))}
    if args.draft_engine:
        dk = args.draft_k or k
        speculators["draft"] = make_speculator(
            SpeculativeConfig("draft", num_speculative_tokens=dk, draft_engine_dir=args.draft_engine), engine.config,
            engine.tokenizer, engine.device, engine.block_manager.num_blocks * engine.block_size,
            engine.scheduler.max_num_seqs)
        speculators["draft!"] = Speculator(SpeculativeConfig("draft", num_speculative_tokens=dk,
                                                             draft_engine_dir=args.draft_engine,
                                                             step_overhead_tokens=always), speculators["draft"].draft)
    engine.speculator = None
    print(f"# spec_bench: {args.engine} (draft {args.draft_engine}, k={args.draft_k or k}), ngram k={k}, "
          f"{args.threads} threads, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average {os.getloadavg()[0]:.1f}")
    run_one(engine, tasks()["chat"][0], 8)  # warm-up
    skip = set(args.skip.split(","))
    if "single" not in skip:  # one stream: the rule keeps the n-gram lookup on, "ngram!" adds nothing
        single_stream(engine, {n: s for n, s in speculators.items() if n != "ngram!"}, args.reps, args.max_tokens)
    if "c16" not in skip:
        concurrency(engine, speculators, args.reps, args.max_tokens)
    if "cost" not in skip:
        step_cost(engine, args.reps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
