"""`python -m tritium.client.bench.bench_device_step --engine DIR [--before REPO]`: decode speed of
the device-step options on CPU (docs/serving.md#the-device-step, figures in docs/benchmarks.md).

In-process generation, single stream and 16 concurrent requests, each mode in its own fresh
process, the modes taking turns for --rounds rounds (the best figure of each is kept) so that a
drifting host load affects them alike. Modes:
  before   another Tritium checkout (--before), its defaults, on the same engine;
  default  this checkout's defaults on CPU (host sampling, plain inputs, no static buffers);
  device   device_sampling + staged inputs (what a GPU runs; here on CPU);
  static   device_sampling + staged inputs + the static decode buffers, eagerly (the CUDA-graph path).
Requests sample (temperature 0.8, top-p 0.95, a seed each) so that the sampler is part of the step.
Prints one table: output tokens/s (wall and process CPU time) and each mode's ratio to `default`.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Dict, Optional

from .bench_determinism import _package_root, _prompts

_DRIVER = r'''
import json, sys, time, torch
torch.set_num_threads(int(sys.argv[2]))
from tritium.backend.engine import LLMEngine
from tritium.backend.sampling_params import SamplingParams
cfg = json.loads(sys.argv[3])
kw = {}
if cfg["options"] is not None:
    from tritium.backend.device_step import DeviceStepOptions
    kw["device_step"] = DeviceStepOptions(**cfg["options"])
eng = LLMEngine(sys.argv[1], device="cpu", enable_prefix_caching=False, **kw)
prompts = cfg["prompts"]
def params(n):
    return [SamplingParams(max_tokens=cfg["max_tokens"], temperature=0.8, top_p=0.95, seed=i, ignore_eos=True)
            for i in range(n)]
eng.generate(prompts[:2], params(2))  # warm-up
out = {}
for name, batch in (("single_stream", prompts[:1]), ("concurrency_16", prompts[:16])):
    best = cpu_best = 0.0
    for _ in range(cfg["repeats"]):
        t, c = time.perf_counter(), time.process_time()
        outs = eng.generate(batch, params(len(batch)))
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        best = max(best, n / (time.perf_counter() - t))
        cpu_best = max(cpu_best, n / (time.process_time() - c))
    out[name] = best
    out[name + "_cpu"] = cpu_best
print("RESULT " + json.dumps(out))
'''

MODES = {
    "default": None,
    "device": {"device_sampling": True, "staged": True, "cuda_graphs": False},
    "static": {"device_sampling": True, "staged": True, "cuda_graphs": True},
}


def run_mode(engine: str, threads: int, options: Optional[dict], max_tokens: int, repeats: int,
             pythonpath: Optional[str] = None) -> Dict[str, float]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    cfg = json.dumps({"options": options, "max_tokens": max_tokens, "repeats": repeats, "prompts": _prompts()})
    r = subprocess.run([sys.executable, "-c", _DRIVER, engine, str(threads), cfg], env=env,
                       capture_output=True, text=True)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if r.returncode != 0 or line is None:
        raise RuntimeError(f"benchmark process failed ({r.returncode}): {r.stderr[-2000:]}")
    return json.loads(line[len("RESULT "):])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tritium.client.bench.bench_device_step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", required=True, help="engine directory (e.g. a bf16 SmolLM2 build)")
    p.add_argument("--before", default=None, metavar="REPO",
                   help="another Tritium checkout (repository root) to measure as 'before'")
    p.add_argument("--modes", default="default,device,static",
                   help=f"comma-separated modes of this checkout among {', '.join(MODES)}")
    p.add_argument("--threads", type=int, default=1, help="torch / OpenMP threads per process (default 1)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="runs per workload and process; the best is kept")
    p.add_argument("--rounds", type=int, default=2, help="times each mode's process runs, in turns")
    a = p.parse_args(argv)
    for name in ("threads", "max_tokens", "repeats", "rounds"):
        if getattr(a, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    names = [m.strip() for m in a.modes.split(",") if m.strip()]
    bad = [m for m in names if m not in MODES]
    if bad or "default" not in names:
        raise SystemExit(f"--modes: {', '.join(MODES)} (default required), got {a.modes!r}")
    results: Dict[str, Dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        modes = [(m, MODES[m], None) for m in names]
        if a.before:
            modes.insert(0, ("before", None, _package_root(a.before, tmp)))
        for _ in range(a.rounds):
            for name, options, path in modes:
                r = run_mode(a.engine, a.threads, options, a.max_tokens, a.repeats, path)
                print(f"# {name}: {json.dumps(r)}", file=sys.stderr, flush=True)
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
