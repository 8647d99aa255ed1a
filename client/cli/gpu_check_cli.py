"""`tritium gpu-check`: one command that proves the CUDA path (docs/kernels.md#gpu-check).

Parts, in order; each prints PASS, FAIL or SKIPPED with its reason:
  placement   tests/test_placement.py (CUDA calls stubbed; runs everywhere)
  engine      a tiny random Llama built float32 and bf16, greedy tokens of the CPU engine; with CUDA
              the same engine on cuda:0 must give the same tokens (float32: all of them; bf16: the
              first BF16_PREFIX, as bf16 rounding on a different device may flip a later near-tie)
  device-step the tiny float32 engine with device sampling and static decode buffers against the
              plain host path: the same greedy and seeded tokens; with CUDA the graphs must have
              replayed and the layer loop runs under torch.cuda.set_sync_debug_mode("error")
  kernels     pytest -m cuda on tests/test_kernels_cuda.py and test_kernels_compile.py (CUDA only)
  serving     a synthetic engine with Llama-3-8B shapes (random weights, --synthetic-layers of the
              32 layers, bf16) in tritonserver on KIND_GPU, measured with `tritium bench` (CUDA only)
  bench       `tritium bench-kernels --quick --check` (CUDA only)
Needs the repository checkout (it runs its tests/). With CUDA, the figures replace the marked
section of --doc (default docs/kernels.md); without CUDA the doc is written only when --doc is
given, so a CPU run never overwrites GPU figures.
"""
from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import tempfile
from typing import Callable, List, Optional

import torch

BEGIN, END = "<!-- gpu-check:begin -->", "<!-- gpu-check:end -->"
PROMPTS = [[5, 17, 300, 42, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1], [100]]
MAX_TOKENS = 24
BF16_PREFIX = 8
CUDA_ONLY = ("kernels", "serving", "bench")
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                 head_dim=128, vocab_size=128256, max_position_embeddings=8192, tie_word_embeddings=False,
                 rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})


def register(sub) -> None:
    p = sub.add_parser("gpu-check", help="prove the CUDA path in one run (CPU parts only without CUDA)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--doc", default=None, help="markdown file whose gpu-check section gets the figures "
                   "(default with CUDA: docs/kernels.md of the checkout)")
    p.add_argument("--synthetic-layers", type=int, default=4, metavar="N",
                   help="decoder layers of the Llama-3-8B-shaped engine (default 4 of 32, to fit build time)")
    p.add_argument("--work-dir", default=None, help="where checkpoints and engines go (default: a temp dir)")
    p.add_argument("--skip", default="", metavar="PARTS",
                   help="comma-separated parts to leave out: placement,engine,device-step,kernels,serving,bench")
    p.set_defaults(func=run)


def repo_root() -> str:
    from tritium import client  # client/ of the checkout (editable install): its parent is the root
    root = os.path.dirname(os.path.dirname(os.path.abspath(client.__file__)))
    if not os.path.isdir(os.path.join(root, "tests")):
        raise ValueError(f"gpu-check runs the repository's tests: no tests/ in {root} (use an editable install "
                         f"of the checkout: pip install -e .)")
    return root


class Report:
    def __init__(self):
        self.rows: List[tuple] = []  # (part, status, detail)
        self.figures: List[str] = []

    def add(self, part: str, status: str, detail: str) -> None:
        self.rows.append((part, status, detail))
        print(f"gpu-check {part}: {status}: {detail}", file=sys.stderr, flush=True)

    @property
    def failed(self) -> bool:
        return any(s == "FAIL" for _, s, _ in self.rows)

    def markdown(self, device: str) -> str:
        lines = [BEGIN, f"`tritium gpu-check`, {datetime.date.today().isoformat()}, on {device}.", "",
                 "| part | result | detail |", "|---|---|---|"]
        lines += [f"| {p} | {s} | {d.replace('|', '/')} |" for p, s, d in self.rows]
        if self.figures:
            lines += ["", "```text"] + self.figures + ["```"]
        return "\n".join(lines + [END])


def write_section(path: str, section: str) -> None:
    """Replace the BEGIN..END section of `path` (append it when absent)."""
    text = open(path, encoding="utf-8").read() if os.path.isfile(path) else ""
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + section + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + section + "\n"
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def _run(cmd: List[str], cwd: str, timeout: int, env: Optional[dict] = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def check_placement(rep: Report, root: str, cuda: bool) -> None:
    r = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_placement.py"], root, 600)
    tail = (r.stdout.strip().splitlines() or [""])[-1]
    rep.add("placement", "PASS" if r.returncode == 0 else "FAIL", tail if r.returncode == 0 else r.stdout[-2000:])


def _greedy(engine_dir: str, device: str) -> List[List[int]]:
    from tritium.backend.engine import LLMEngine
    from tritium.backend.sampling_params import SamplingParams
    eng = LLMEngine(engine_dir, device=device, num_kv_blocks=64)
    try:
        outs = eng.generate(prompt_token_ids=PROMPTS, params=SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                                            ignore_eos=True))
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        eng.close()


def _tiny_engines(work: str, root: str) -> dict:
    sys.path.insert(0, os.path.join(root, "tests"))
    from tiny_models import make_checkpoint
    from tritium.builder.build import BuildOptions, build_engine
    ckpt = make_checkpoint("llama", os.path.join(work, "tiny-llama"))
    out = {}
    for dtype in ("float32", "bfloat16"):
        out[dtype] = os.path.join(work, f"tiny-llama-{dtype}")
        build_engine(BuildOptions(source=ckpt, output=out[dtype], dtype=dtype, progress=False))
    return out


def check_engine(rep: Report, root: str, cuda: bool, work: str) -> None:
    engines = _tiny_engines(work, root)
    for dtype, path in engines.items():
        ref = _greedy(path, "cpu")
        if not all(len(t) == MAX_TOKENS for t in ref):
            rep.add(f"engine {dtype}", "FAIL", f"CPU engine gave {[len(t) for t in ref]} tokens, wanted {MAX_TOKENS}")
            continue
        if not cuda:
            rep.add(f"engine {dtype}", "SKIPPED", f"CPU half ran ({len(ref)} prompts x {MAX_TOKENS} greedy tokens); "
                    "no CUDA device (torch.cuda.is_available() is False) to compare against")
            continue
        got = _greedy(path, "cuda:0")
        want = MAX_TOKENS if dtype == "float32" else BF16_PREFIX
        same = [next((i for i, (a, b) in enumerate(zip(g, r)) if a != b), MAX_TOKENS) for g, r in zip(got, ref)]
        ok = min(same) >= want
        rep.add(f"engine {dtype}", "PASS" if ok else "FAIL",
                f"CUDA vs CPU greedy tokens equal for the first {same} of {MAX_TOKENS} (needs >= {want})")


def _device_step_tokens(engine_dir: str, device: str, options, watch_syncs: bool = False):
    from tritium.backend.engine import LLMEngine
    from tritium.backend.sampling_params import SamplingParams
    eng = LLMEngine(engine_dir, device=device, num_kv_blocks=64, device_step=options)
    hooks = []
    if watch_syncs:  # any synchronising call inside the layer loop raises
        layers = eng.runner.model.layers
        hooks.append(layers[0].register_forward_pre_hook(lambda *a: torch.cuda.set_sync_debug_mode("error")))
        hooks.append(layers[-1].register_forward_hook(lambda *a: torch.cuda.set_sync_debug_mode("default")))
    try:
        params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
                  SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True),
                  SamplingParams(max_tokens=MAX_TOKENS, temperature=0.7, top_k=20, seed=8, ignore_eos=True)]
        outs = eng.generate(prompt_token_ids=PROMPTS, params=params)
        sd = eng.runner.static_decode
        return [list(o.outputs[0].token_ids) for o in outs], (sd.num_replays if sd is not None else 0)
    finally:
        for h in hooks:
            h.remove()
        if watch_syncs:
            torch.cuda.set_sync_debug_mode("default")
        eng.close()


def check_device_step(rep: Report, root: str, cuda: bool, work: str) -> None:
    from tritium.backend.device_step import DeviceStepOptions
    path = os.path.join(work, "tiny-llama-float32")
    if not os.path.isfile(os.path.join(path, "engine.json")):
        path = _tiny_engines(work, root)["float32"]
    device = "cuda:0" if cuda else "cpu"
    plain, _ = _device_step_tokens(path, device, DeviceStepOptions(False, False, False))
    fast, replays = _device_step_tokens(path, device, DeviceStepOptions(True, True, True))
    if fast != plain:
        rep.add("device-step", "FAIL", f"device sampling + static buffers on {device} gave other tokens than the "
                "host path")
        return
    if not cuda:
        rep.add("device-step", "SKIPPED", "CPU half ran (static buffers eagerly, device sampler: the host path's "
                "tokens); no CUDA device for the graphs and the sync check")
        return
    staged, _ = _device_step_tokens(path, device, DeviceStepOptions(True, True, False), watch_syncs=True)
    ok = replays > 0 and staged == plain
    rep.add("device-step", "PASS" if ok else "FAIL", f"same tokens with graphs ({replays} replays) and staged "
            f"eager steps under set_sync_debug_mode('error') in the layer loop: {staged == plain}")


def check_kernels(rep: Report, root: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = _run([sys.executable, "-m", "pytest", "-q", "-rs", "-m", "cuda", "-p", "no:cacheprovider",
              "tests/test_kernels_cuda.py", "tests/test_kernels_compile.py"], root, 3600, env)
    tail = (r.stdout.strip().splitlines() or [""])[-1]
    rep.add("kernels", "PASS" if r.returncode == 0 else "FAIL", tail if r.returncode == 0 else r.stdout[-2000:])


def check_bench_kernels(rep: Report, root: str) -> None:
    r = _run([sys.executable, "-m", "tritium.client.cli", "bench-kernels", "--quick", "--check"], root, 3600)
    rep.add("bench-kernels", "PASS" if r.returncode == 0 else "FAIL", "figures below" if r.returncode == 0
            else r.stderr[-2000:])
    rep.figures += ["$ tritium bench-kernels --quick --check"] + r.stdout.strip().splitlines()


def check_serving(rep: Report, root: str, work: str, layers: int) -> None:
    sys.path.insert(0, os.path.join(root, "tests"))
    from tiny_models import make_checkpoint
    from tritium.builder.build import BuildOptions, build_engine
    from tritium.builder.repository import write_repository
    from tritium.client.serve.server import TritonServer
    ckpt = make_checkpoint("llama", os.path.join(work, "llama3-8b-shapes"), init_std=0.02,
                           num_hidden_layers=layers, **LLAMA3_8B)
    engine, repo = os.path.join(work, "llama3-8b-shapes-engine"), os.path.join(work, "repo")
    build_engine(BuildOptions(source=ckpt, output=engine, dtype="bfloat16", max_batch_size=64, progress=False))
    write_repository(repo, "synthetic8b", engine, device="cuda", gpus=[0])
    cmd = ["bench", "--model", "synthetic8b", "--num-requests", "64", "--concurrency", "1,16,64",
           "--output-len", "128", "128", "--no-progress"]
    with TritonServer(repo) as srv:
        r = _run([sys.executable, "-m", "tritium.client.cli"] + cmd + ["--url", srv.grpc_url.split("://")[-1],
                                                                     "--triton-protocol", "grpc"],
                 root, 3600)
    rep.add("serving", "PASS" if r.returncode == 0 else "FAIL",
            f"Llama-3-8B shapes, {layers} of 32 layers, random bf16 weights, KIND_GPU on GPU 0"
            + ("" if r.returncode == 0 else ": " + r.stderr[-2000:]))
    rep.figures += ["", f"$ tritium {' '.join(cmd)}  # synthetic Llama-3-8B shapes, {layers} layers"]
    rep.figures += (r.stdout + r.stderr).strip().splitlines()[-40:]


def run(args: argparse.Namespace) -> int:
    root = repo_root()
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    bad = skip - {"placement", "engine", "device-step", "kernels", "serving", "bench"}
    if bad:
        raise ValueError(f"--skip: unknown parts {sorted(bad)}; allowed: "
                         f"placement,engine,device-step,kernels,serving,bench")
    if args.synthetic_layers < 1 or args.synthetic_layers > 32:
        raise ValueError(f"--synthetic-layers must be 1..32, got {args.synthetic_layers}")
    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name(0) if cuda else "CPU only (no CUDA device)"
    rep = Report()
    no_cuda = "no CUDA device (torch.cuda.is_available() is False)"
    with tempfile.TemporaryDirectory(prefix="tritium-gpu-check-") as tmp:
        work = args.work_dir or tmp
        parts: List[tuple] = [("placement", lambda: check_placement(rep, root, cuda)),
                              ("engine", lambda: check_engine(rep, root, cuda, work)),
                              ("device-step", lambda: check_device_step(rep, root, cuda, work))]
        cuda_parts: List[tuple] = [("kernels", lambda: check_kernels(rep, root)),
                                   ("serving", lambda: check_serving(rep, root, work, args.synthetic_layers)),
                                   ("bench", lambda: check_bench_kernels(rep, root))]
        for name, fn in parts + cuda_parts:
            if name in skip:
                rep.add(name, "SKIPPED", "--skip")
            elif not cuda and name in CUDA_ONLY:
                rep.add(name, "SKIPPED", no_cuda)
            else:
                _guard(rep, name, fn)
    doc = args.doc or (os.path.join(root, "docs", "kernels.md") if cuda else None)
    if doc:
        write_section(doc, rep.markdown(device))
        print(f"gpu-check: figures written to {doc}", file=sys.stderr)
    print(f"gpu-check: {'FAILED' if rep.failed else 'passed'} on {device}"
          + ("" if cuda else "; the CUDA parts were skipped (no CUDA device)"), file=sys.stderr)
    return 1 if rep.failed else 0


def _guard(rep: Report, name: str, fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception as e:  # one part failing must not hide the others' results
        rep.add(name, "FAIL", f"{type(e).__name__}: {' '.join(str(e).split())[:500]}")
