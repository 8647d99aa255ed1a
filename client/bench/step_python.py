"""Where a decode step's Python goes, part by part: a benchmark that prints figures.

    python -m tritium.client.bench.step_python ENGINE_DIR [--batch 1] [--tokens 64] [--rounds 3]
        [--threads 1] [--stub-native]

Runs --batch greedy requests of --tokens decode tokens (EOS ignored) on an LLMEngine (prefix
caching off) with a timer around each part of a step: the calling thread's CPU time (other
processes' time on a shared host does not count), per decode step (the prompt's step is not
counted), best round (least step time) printed. The parts, in the order a step runs them:
scheduler, host arrays (prepare_arrays), tensors and attention metadata (inputs), embedding lookup
(and, inside it, the int8 codes gather), rotary tables, the native step's checks and call (and,
inside it, the native layers; where the whole step is one native call, its lookup, rotary rows
and final norm count as native layers), the final norm, the LM head, sampling, appending the tokens (and,
inside it, the detokenizer), the request outputs. "Python and sampling" is the step less the
native layers and the LM head. Each timer adds about 1 us. A decode-only step of <= 32 rows feeds
the native call from kept buffers (backend/native_decode.py) instead of prepare_arrays and inputs:
"decode inputs (kept buffers)" is that path less the call it makes.

--stub-native replaces the whole-step native call with a stub that does no kernel work (each row's
token set to one fixed id): what is left is the step's Python and ctypes alone, whose wall time
per decode step (median of each round, best round) it prints without part timers. A loaded host
moves it far less than a step with its kernels, so two trees compare well this way (run this
file by path with the other tree first on PYTHONPATH).
"""
from __future__ import annotations

import argparse
import collections
import time

import torch

from tritium.backend import detokenizer as detok_mod, sequence as seq_mod
from tritium.backend.engine import LLMEngine
from tritium.backend.models import native_step
from tritium.backend.sampling_params import SamplingParams
from tritium.client.bench.native_step_bench import PROMPT
from tritium.kernels import decode_layer, ops

try:  # the whole step in one native call (kernels/decode_step.py), where this code has it
    from tritium.kernels import decode_step
except ImportError:
    decode_step = None
try:  # decode-only steps from kept buffers (backend/native_decode.py), where this code has it
    from tritium.backend import native_decode
except ImportError:
    native_decode = None

# (label, indent): the order printed; an indented part is inside the one above it
PARTS = [("schedule", 0), ("decode inputs (kept buffers)", 0), ("prepare_arrays", 0), ("inputs", 0), ("embed", 0),
         ("embed codes", 1),
         ("rope_state", 0), ("native checks (takes)", 0), ("native step", 0), ("native layers", 1),
         ("final norm", 0), ("LM head", 0), ("sample", 0), ("append tokens", 0), ("detokenize", 1),
         ("request outputs", 0), ("step", 0)]


def instrument(eng: LLMEngine, acc: dict) -> None:
    """Wraps each part's function (on the objects, or their classes) with a CPU-time timer."""
    clock = time.thread_time

    def wrap(obj, name, label):
        f = getattr(obj, name, None)
        if f is None:
            return

        def timed(*a, **k):
            t = clock()
            try:
                return f(*a, **k)
            finally:
                acc[label] += clock() - t
        setattr(obj, name, timed)

    model, runner = eng.runner.model, eng.runner
    wrap(eng.scheduler, "schedule", "schedule")
    wrap(runner, "prepare_arrays", "prepare_arrays")
    wrap(runner, "inputs", "inputs")
    wrap(model, "embed", "embed")
    if getattr(model, "embed_tokens", None) is not None:
        wrap(model.embed_tokens, "codes", "embed codes")
    wrap(model, "rope_state", "rope_state")
    wrap(native_step.NativeStep, "takes", "native checks (takes)")
    wrap(native_step.NativeStep, "run", "native step")
    wrap(decode_layer.DecodeLayers, "run", "native layers")
    if decode_step is not None:  # the whole step: lookup, rotary rows, layers and final norm in C
        wrap(native_step.NativeStep, "run_step", "native step")
        wrap(decode_step.DecodeStep, "run", "native layers")
    wrap(ops, "rms_norm", "final norm")  # the native step runs the layers' norms in C
    wrap(model, "compute_logits", "LM head")
    wrap(runner, "sample", "sample")
    wrap(seq_mod.Sequence, "append_token", "append tokens")
    wrap(detok_mod.IncrementalDetokenizer, "add_tokens", "detokenize")
    wrap(seq_mod.Request, "output", "request outputs")
    wrap(eng, "step", "step")
    if getattr(runner, "native_decode", None) is not None:  # its own time less the call it makes
        wrap(runner.native_decode, "run", "_fast")
        wrap(model, "decode_logits", "_fast call")


def stub_native() -> None:
    """The whole-step native call does no kernel work: each row's token (where the call runs the
    head) is set to id 1, logits stay as allocated."""
    import ctypes
    lib = decode_step._lib()

    def stub(*a):
        t, tokens = a[6], a[-1]
        for i in range(t if tokens is not None else 0):
            ctypes.c_int64.from_address(tokens + 8 * i).value = 1
        return 0
    lib.tritium_decode_step_bf16 = stub


def stub_round(eng: LLMEngine, tokens: int, batch: int) -> float:
    """Median wall ms per decode step of one round."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        eng.add_request(f"s{time.monotonic_ns()}-{i}", prompt=PROMPT, params=params)
    eng.step()
    times = []
    while eng.has_unfinished():
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2] * 1e3


def one_round(eng: LLMEngine, acc: dict, tokens: int, batch: int) -> dict:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        eng.add_request(f"p{time.monotonic_ns()}-{i}", prompt=PROMPT, params=params)
    eng.step()  # the prompt: not counted
    acc.clear()
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
    out = {k: v / max(steps, 1) * 1e3 for k, v in acc.items()}
    if "_fast" in out:
        out["decode inputs (kept buffers)"] = out.pop("_fast") - out.pop("_fast call", 0.0)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("engine")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--stub-native", action="store_true",
                   help="no kernel work in the whole-step native call: the step's Python and ctypes alone")
    args = p.parse_args(argv)
    for name in ("batch", "tokens", "rounds", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    torch.set_num_threads(args.threads)
    eng = LLMEngine(args.engine, enable_prefix_caching=False, max_decode_burst=1)  # one step a call: per-step figures
    acc: dict = collections.defaultdict(float)
    one_round(eng, acc, 8, args.batch)  # warm-up (and the native step's build)
    if args.stub_native:
        if decode_step is None:
            p.error("--stub-native: this tree has no whole-step native call (kernels/decode_step.py)")
        stub_native()
        best = min(stub_round(eng, args.tokens, args.batch) for _ in range(args.rounds))
        print(f"{args.engine}: batch {args.batch}, {args.tokens} tokens, best of {args.rounds}, native call stubbed: "
              f"{best:.4f} ms wall per decode step (Python and ctypes)")
        return 0
    instrument(eng, acc)
    best = None
    for _ in range(args.rounds):
        cur = one_round(eng, acc, args.tokens, args.batch)
        if best is None or cur.get("step", 0.0) < best.get("step", 0.0):
            best = cur
    step = best.get("step", 0.0)
    print(f"{args.engine}: batch {args.batch}, {args.tokens} tokens, best of {args.rounds}, "
          f"{torch.get_num_threads()} thread(s); thread CPU ms per decode step")
    for label, indent in PARTS:
        if label in best:
            print(f"{'  ' * indent + label:28s} {best[label]:7.3f}  {100 * best[label] / step:5.1f}%")
    rest = step - best.get("native layers", 0.0) - best.get("LM head", 0.0)
    print(f"{'python and sampling':28s} {rest:7.3f}  {100 * rest / step:5.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
