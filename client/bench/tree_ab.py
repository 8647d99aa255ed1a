"""One engine's decode under two source trees, rounds interleaved: a benchmark that prints figures.

    python -m tritium.client.bench.tree_ab ENGINE_DIR --base TREE [--threads 2] [--batch 1]
        [--tokens 48] [--pairs 14]

TREE is a folder holding another revision's `tritium` package (e.g. `git archive main` unpacked
into TREE/tritium). Two worker processes load ENGINE_DIR (an LLMEngine each, prefix caching
off), one importing this tree, one with TREE first on PYTHONPATH (this file runs by path there,
so the base revision needs none of it). Per pair each runs one round, the order flipped every
pair: --batch greedy requests (EOS ignored), their prompt step, then --tokens decode steps. For
each round: decode tokens/s, and the step's Python beside the native whole-step call (the median
over the round's steps of the step's time less the call's, wall and thread CPU), next to the
host's 2-thread read rate of a 256 MiB buffer on 2 MiB pages measured just before the pair (the
host's memory state moves every few seconds on a shared machine). Summary: the median ratio of
this tree's tokens/s to the base's over the pairs, and each tree's medians.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def worker(engine_dir: str, threads: int) -> int:
    """Reads 'tokens batch' lines, prints one JSON line per round."""
    import torch
    from tritium.backend.engine import LLMEngine
    from tritium.backend.sampling_params import SamplingParams
    from tritium.client.bench.native_step_bench import PROMPT
    from tritium.kernels import cpu_native
    torch.set_num_threads(threads)
    eng = LLMEngine(engine_dir, enable_prefix_caching=False)
    calls = []

    def run(tokens: int, batch: int) -> dict:
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        for i in range(batch):
            eng.add_request(f"ab{time.monotonic_ns()}-{i}", prompt=PROMPT, params=params)
        eng.step()  # the prompt
        calls.clear()
        wall, cpu = [], []
        start = time.perf_counter()
        while eng.has_unfinished():
            c, t = time.thread_time(), time.perf_counter()
            eng.step()
            wall.append(time.perf_counter() - t)
            cpu.append(time.thread_time() - c)
        total = time.perf_counter() - start
        out = {"tok_s": batch * len(wall) / total, "step_ms": statistics.median(wall) * 1e3}
        if len(calls) == len(wall):  # every decode step was one whole-step call
            out["py_ms"] = statistics.median(w - c[0] for w, c in zip(wall, calls)) * 1e3
            out["py_cpu_ms"] = statistics.median(u - c[1] for u, c in zip(cpu, calls)) * 1e3
        return out
    run(8, 1)  # warm-up (and the native step's build)
    lib = cpu_native._lib()
    fn = getattr(lib, "tritium_decode_step_bf16", None) if lib is not None else None
    if fn is not None:
        def timed(*a):
            c, t = time.thread_time(), time.perf_counter()
            rc = fn(*a)
            calls.append((time.perf_counter() - t, time.thread_time() - c))
            return rc
        lib.tritium_decode_step_bf16 = timed
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        tokens, batch = map(int, line.split())
        print(json.dumps(run(tokens, batch)), flush=True)
    return 0


def _start(engine_dir: str, threads: int, pythonpath):
    # one step a call in both trees (decode bursts off; a tree without them ignores the variable)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TRITIUM_DECODE_BURST="1")
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", engine_dir, str(threads)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True, cwd="/")
    for line in p.stdout:
        if line.startswith("{"):
            return p
    raise SystemExit(f"a worker ({'base' if pythonpath else 'this tree'}) failed to start")


def _read_rate() -> float:
    import torch
    from tritium.kernels import hugepages
    n = 256 * (1 << 20) // 4
    if not hasattr(_read_rate, "buf"):
        _read_rate.buf = hugepages.to_huge_pages([torch.ones(n)])[0]
    t = time.perf_counter()
    _read_rate.buf.sum()
    return n * 4 / (time.perf_counter() - t) / 1e9


def main(argv=None) -> int:
    if argv is None and len(sys.argv) == 4 and sys.argv[1] == "--worker":
        return worker(sys.argv[2], int(sys.argv[3]))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("engine")
    p.add_argument("--base", required=True, help="a folder holding the other revision's tritium package")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--pairs", type=int, default=14)
    args = p.parse_args(argv)
    for name in ("threads", "batch", "tokens", "pairs"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if not os.path.isdir(os.path.join(args.base, "tritium")):
        p.error(f"--base {args.base!r} holds no tritium package folder")
    import torch
    torch.set_num_threads(2)
    workers = {"base": _start(args.engine, args.threads, os.path.abspath(args.base)),
               "this tree": _start(args.engine, args.threads, None)}
    res = {k: [] for k in workers}
    try:
        for i in range(args.pairs):
            bw = _read_rate()
            got = {}
            for name in (("base", "this tree") if i % 2 == 0 else ("this tree", "base")):
                w = workers[name]
                w.stdin.write(f"{args.tokens} {args.batch}\n")
                w.stdin.flush()
                got[name] = json.loads(w.stdout.readline())
                res[name].append(got[name])
            b, m = got["base"], got["this tree"]
            print(f"read {bw:5.1f} GB/s | base {b['tok_s']:7.1f} tok/s, Python {b.get('py_ms', float('nan')):.3f} ms"
                  f" | this tree {m['tok_s']:7.1f} tok/s, Python {m.get('py_ms', float('nan')):.3f} ms"
                  f" | ratio {m['tok_s'] / b['tok_s']:.3f}", flush=True)
    finally:
        for w in workers.values():
            w.stdin.close()
            w.wait()
    ratios = [m["tok_s"] / b["tok_s"] for m, b in zip(res["this tree"], res["base"])]

    def med(name, key):
        vals = [r[key] for r in res[name] if key in r]
        return statistics.median(vals) if vals else float("nan")
    print(f"{os.path.basename(args.engine.rstrip('/'))}, batch {args.batch}, {args.threads} thread(s), {args.pairs} pairs: "
          f"this tree / base tok/s median {statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f})")
    for name in ("base", "this tree"):
        print(f"  {name:9s} {med(name, 'tok_s'):8.1f} tok/s, step {med(name, 'step_ms'):.3f} ms, Python beside the "
              f"call {med(name, 'py_ms'):.3f} ms wall / {med(name, 'py_cpu_ms'):.3f} ms thread CPU")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
