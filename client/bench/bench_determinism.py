"""`python -m tritium.client.bench.bench_determinism --engine DIR [--before REPO]`: what batch-invariant
numerics cost (docs/determinism.md). In-process greedy generation, single stream and concurrency
16, for the engine's default kernels, the `deterministic` option, and (with --before) another
Tritium checkout's kernels on the same engine; each mode in its own fresh process, the modes
taking turns for --rounds rounds (the best figure of each mode is kept), so that a host whose load
drifts during the run affects every mode alike.

Prints one table: output tokens per second of wall time and per second of the process's CPU time
(with one thread the latter is the work done, far less sensitive to other jobs on a shared host),
per mode and workload, and each mode's ratio to the default.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional

# Run as a script by each mode's process: only the engine API every Tritium version has.
_DRIVER = r'''
import json, sys, time, torch
torch.set_num_threads(int(sys.argv[2]))
from tritium.backend.engine import LLMEngine
from tritium.backend.sampling_params import SamplingParams
cfg = json.loads(sys.argv[3])
kw = {"deterministic": True} if cfg["deterministic"] else {}
eng = LLMEngine(sys.argv[1], device="cpu", enable_prefix_caching=False, **kw)
params = SamplingParams(max_tokens=cfg["max_tokens"], temperature=0.0, ignore_eos=True)
prompts = cfg["prompts"]
eng.generate(prompts[:2], params)  # warm-up: native kernels loaded, buffers allocated
out = {}
for name, batch in (("single_stream", prompts[:1]), ("concurrency_16", prompts[:16])):
    best = cpu_best = 0.0
    for _ in range(cfg["repeats"]):
        t, c = time.perf_counter(), time.process_time()
        outs = eng.generate(batch, params)
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        best = max(best, n / (time.perf_counter() - t))
        cpu_best = max(cpu_best, n / (time.process_time() - c))
    out[name] = best
    out[name + "_cpu"] = cpu_best
print("RESULT " + json.dumps(out))
'''

QUESTIONS = ["What is the capital of France?", "Explain why the sky is blue.", "Write a haiku about rain.",
             "Name three uses of copper.", "How do vaccines work?", "What is a prime number?",
             "Describe a cat in one sentence.", "Why do leaves change colour?", "What is photosynthesis?",
             "Give a tip for learning to cook.", "What does a compiler do?", "How far is the Moon?",
             "What is the boiling point of water?", "Who wrote Hamlet?", "What is an atom?",
             "Suggest a name for a bakery."]


def _prompts() -> List[str]:
    return [f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n" for q in QUESTIONS]


def _package_root(repo: str, tmp: str) -> str:
    """A folder whose `tritium` package is the checkout `repo` (its backend/, kernels/, ...)."""
    pkg = os.path.join(tmp, "tritium")
    os.makedirs(pkg)
    open(os.path.join(pkg, "__init__.py"), "w").close()
    for sub in ("backend", "kernels", "builder", "client"):
        src = os.path.join(os.path.abspath(repo), sub)
        if not os.path.isdir(src):
            raise ValueError(f"--before {repo!r}: no {sub}/ folder (expected a Tritium checkout)")
        os.symlink(src, os.path.join(pkg, sub))
    return tmp


def run_mode(engine: str, threads: int, deterministic: bool, max_tokens: int, repeats: int,
             pythonpath: Optional[str] = None) -> Dict[str, float]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    cfg = json.dumps({"deterministic": deterministic, "max_tokens": max_tokens, "repeats": repeats,
                      "prompts": _prompts()})
    r = subprocess.run([sys.executable, "-c", _DRIVER, engine, str(threads), cfg], env=env,
                       capture_output=True, text=True)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if r.returncode != 0 or line is None:
        raise RuntimeError(f"benchmark process failed ({r.returncode}): {r.stderr[-2000:]}")
    return json.loads(line[len("RESULT "):])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tritium.client.bench.bench_determinism", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", required=True, help="engine directory (e.g. a bf16 SmolLM2 build)")
    p.add_argument("--before", default=None, metavar="REPO",
                   help="another Tritium checkout (repository root) to measure as 'before'")
    p.add_argument("--threads", type=int, default=1, help="torch / OpenMP threads per process (default 1)")
    p.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per request (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="runs per workload and process; the best is kept (default 3)")
    p.add_argument("--rounds", type=int, default=2, help="times each mode's process runs, in turns (default 2)")
    a = p.parse_args(argv)
    for name in ("threads", "max_tokens", "repeats", "rounds"):
        if getattr(a, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    results: Dict[str, Dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        modes = [("default", False, None), ("deterministic", True, None)]
        if a.before:
            modes.insert(0, ("before", False, _package_root(a.before, tmp)))
        for _ in range(a.rounds):
            for name, det, path in modes:
                r = run_mode(a.engine, a.threads, det, a.max_tokens, a.repeats, path)
                best = results.setdefault(name, r)
                for k, v in r.items():
                    best[k] = max(best[k], v)
    base = results["default"]
    cols = [("single_stream", "single stream tok/s"), ("single_stream_cpu", "single stream tok/CPU-s"),
            ("concurrency_16", "concurrency 16 tok/s"), ("concurrency_16_cpu", "concurrency 16 tok/CPU-s")]
    print("| mode | " + " | ".join(f"{h} | x default" for _, h in cols) + " |")
    print("|---" * (1 + 2 * len(cols)) + "|")
    for mode, r in results.items():
        print(f"| {mode} | " + " | ".join(f"{r[k]:.1f} | {r[k] / base[k]:.2f}" for k, _ in cols) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
