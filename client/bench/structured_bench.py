"""Structured-output benchmark: `python -m tritium.client.bench.structured_bench --engine E`.

In-process, on the engine's device with --threads torch threads (default 2). Figures:
1. throughput at concurrency 16 (closed loop: a finished request is replaced at once, so 16 run
   in every step), generated tokens / wall time, with half of the requests JSON-schema
   constrained against none constrained; runs interleaved (the host drifts), the ratio of the
   medians is the cost of constrained decoding;
   The two configurations also differ in output lengths (a constrained answer ends with its
   JSON), so the grammar's own work is timed too: the seconds spent masking logits and
   advancing matchers, as a share of the constrained runs' wall time;
2. schema compile time: the vocabulary's TokenizerInfo (once per engine), a cold compile per
   schema (a fresh compiler), and a cached one (the LRU hit).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import List

from tritium.backend import sampler as sampler_module
from tritium.backend.engine import LLMEngine
from tritium.backend.guided import state as guided_state
from tritium.backend.guided.compiler import GuideCompiler
from tritium.backend.guided.params import json_schema
from tritium.backend.sampling_params import SamplingParams

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                      "email": {"type": "string"}}, "required": ["name", "age", "email"]},
    {"type": "object", "properties": {"title": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"},
                                                                          "maxItems": 6},
                                      "rating": {"enum": [1, 2, 3, 4, 5]}}, "required": ["title", "tags", "rating"]},
    {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"},
                                      "population": {"type": "integer"}, "capital": {"type": "boolean"}},
     "required": ["city", "country", "population", "capital"]},
    {"type": "object", "properties": {"steps": {"type": "array", "items": {"type": "object", "properties": {
        "action": {"type": "string"}, "minutes": {"type": "integer"}}, "required": ["action", "minutes"]},
        "maxItems": 4}}, "required": ["steps"]},
]
PROMPTS = ["Describe a person as JSON.", "Give a book review as JSON.", "Tell me about a city, as JSON.",
           "Write a recipe as a JSON list of steps.", "Tell me a short story.", "Explain how rain forms."]


def _chat(user: str) -> str:
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def closed_loop(engine: LLMEngine, num_requests: int, concurrency: int, constrained_share: float,
                max_tokens: int) -> float:
    """Generated tokens per second with `concurrency` requests always in flight."""
    made = done = tokens = 0
    guides = [json_schema(s, "bench") for s in SCHEMAS]

    def add():
        nonlocal made
        i = made
        guided = guides[i % len(guides)] if (i % 2 == 0 and constrained_share > 0) else None
        p = SamplingParams(max_tokens=max_tokens, temperature=0.7, guided=guided,
                           ignore_eos=guided is None)
        engine.add_request(f"b{time.monotonic_ns()}-{i}", prompt=_chat(PROMPTS[i % len(PROMPTS)]), params=p)
        made += 1
    for _ in range(concurrency):
        add()
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            tokens += sum(len(c.new_token_ids) for c in out.outputs)
            if out.finished:
                done += 1
                if made < num_requests:
                    add()
    return tokens / (time.perf_counter() - t0)


class GrammarClock:
    """Wall time inside the engine's grammar hooks (mask_logits, dead_end, trim / verify masks)."""

    def __init__(self):
        self.seconds = 0.0
        for mod, name in ((sampler_module, "mask_logits"), (guided_state, "dead_end")):
            setattr(mod, name, self._timed(getattr(mod, name)))

    def _timed(self, fn):
        def run(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.seconds += time.perf_counter() - t0
        return run


def compile_times(engine: LLMEngine) -> dict:
    cfg = engine.config.model
    t0 = time.perf_counter()
    comp = GuideCompiler(engine.tokenizer, cfg.vocab_size, cfg.eos_token_ids)
    comp._xgr_compiler()  # the TokenizerInfo and the xgrammar compiler
    info_s = time.perf_counter() - t0
    cold, cached = [], []
    for s in SCHEMAS:
        g = json_schema(s, "bench")
        t0 = time.perf_counter()
        comp.compile(g)
        cold.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        comp.compile(g)
        cached.append(time.perf_counter() - t0)
    comp.close()
    return {"tokenizer_info_ms": info_s * 1e3, "cold_ms": [c * 1e3 for c in cold],
            "cached_ms": [c * 1e3 for c in cached]}


def main(argv: List[str] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of each configuration (default 3)")
    ap.add_argument("--requests", type=int, default=48, help="requests per round (default 48)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args(argv)
    import torch
    torch.set_num_threads(args.threads)
    engine = LLMEngine(args.engine, max_num_seqs=args.concurrency)
    ct = compile_times(engine)
    print(f"compile: TokenizerInfo {ct['tokenizer_info_ms']:.1f} ms once; cold per schema "
          + ", ".join(f"{v:.1f}" for v in ct["cold_ms"]) + " ms; cached "
          + ", ".join(f"{v:.3f}" for v in ct["cached_ms"]) + " ms")
    clock = GrammarClock()
    closed_loop(engine, args.concurrency, args.concurrency, 0.5, 8)  # warm-up (and compile the schemas)
    runs = {"none": [], "half": []}
    grammar_share = []
    for r in range(args.rounds):
        for name, share in (("none", 0.0), ("half", 0.5)):
            clock.seconds, t0 = 0.0, time.perf_counter()
            tps = closed_loop(engine, args.requests, args.concurrency, share, args.max_tokens)
            runs[name].append(tps)
            if share:
                grammar_share.append(clock.seconds / (time.perf_counter() - t0))
            print(f"round {r}: {name:4s} constrained  {tps:8.1f} tokens/s  (grammar work "
                  f"{100 * clock.seconds / (time.perf_counter() - t0):.2f}% of the wall time)", flush=True)
    none, half = statistics.median(runs["none"]), statistics.median(runs["half"])
    print(json.dumps({"concurrency": args.concurrency, "threads": args.threads, "median_tokens_per_s_none": none,
                      "median_tokens_per_s_half_constrained": half, "ratio_half_over_none": half / none,
                      "grammar_share_of_wall_time": statistics.median(grammar_share),
                      "compile": ct}))
    print(f"throughput, half the rows JSON-schema constrained / none: {half / none:.3f} "
          f"(cost {100 * (1 - half / none):.1f}%); grammar work {100 * statistics.median(grammar_share):.2f}% "
          f"of the constrained runs' wall time")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
