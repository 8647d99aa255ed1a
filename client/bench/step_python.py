"""Where a decode step's Python goes, part by part: a benchmark that prints figures.

    python -m tritium.client.bench.step_python ENGINE_DIR [--batch 1] [--tokens 64] [--rounds 3]
        [--threads 1]

Runs --batch greedy requests of --tokens decode tokens (EOS ignored) on an LLMEngine (prefix
caching off) with a timer around each part of a step: the calling thread's CPU time (other
processes' time on a shared host does not count), per decode step (the prompt's step is not
counted), best round (least step time) printed. The parts, in the order a step runs them:
scheduler, host arrays (prepare_arrays), tensors and attention metadata (inputs), embedding lookup
(and, inside it, the int8 codes gather), rotary tables, the native step's checks and call (and,
inside it, the native layers; where the whole step is one native call, its lookup, rotary rows
and final norm count as native layers), the final norm, the LM head, sampling, appending the tokens (and,
inside it, the detokenizer), the request outputs. "Python and sampling" is the step less the
native layers and the LM head. Each timer adds about 1 us.
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

# (label, indent): the order printed; an indented part is inside the one above it
PARTS = [("schedule", 0), ("prepare_arrays", 0), ("inputs", 0), ("embed", 0), ("embed codes", 1),
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
    return {k: v / max(steps, 1) * 1e3 for k, v in acc.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("engine")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    for name in ("batch", "tokens", "rounds", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    torch.set_num_threads(args.threads)
    eng = LLMEngine(args.engine, enable_prefix_caching=False)
    acc: dict = collections.defaultdict(float)
    one_round(eng, acc, 8, args.batch)  # warm-up (and the native step's build)
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
