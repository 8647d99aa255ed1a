"""Where a decode step's time goes, op by op, against the bytes each op reads: a benchmark that
prints figures.

    python -m tritium.client.bench.step_profile ENGINE_DIR [--batch 1] [--tokens 64] [--rounds 3]
        [--threads 1] [--bandwidth-gbs G] [--wall] [--state-gbs G]

Runs --batch greedy requests of --tokens decode tokens on the native decode step with its per-op
timer on (TRITIUM_STEP_PROFILE=1, thread 0's CPU time per op inside kernels/cpu_decode_layer.c),
the whole-step call's lookup and rotary rows plus final norm, and its LM head plus argmax
(kernels/cpu_decode_step.c), the LM head's where Python runs it (compute_logits, the calling
thread's CPU time) and the whole step's (the
process's CPU time divided by --threads) from Python: CPU time, so that other processes on a
shared host do not count (--wall: wall-clock times instead, for two threads' barrier waits); the
best round (least step time) is printed. Per op: milliseconds per step, the bytes it reads from
memory per step (the weights of that linear in all layers, the KV cache read by attention, the
head's weights), the time those bytes take at the read bandwidth (--bandwidth-gbs, or the
float32 sum of native_step_bench on 2 MiB pages, as the weights lie), and op time / memory time
(1.0: the op runs at the bandwidth). "python and sampling" is the step less the native parts and
the head (the call's glue, sampling, scheduler and bookkeeping). On several threads a second column
gives thread 1's time per op in the layers (its barrier waits apart).

--state-gbs G: for a host whose memory bandwidth flips between states, each round is bracketed by
a 2-thread read of 128 MiB on 2 MiB pages (the same second's bandwidth); rounds where both reads
are >= G count as "fast", both in [G / 2, G) as "slow", one < G / 2 as "contended" (other
processes on the memory bus; others are dropped), and one table per state gives each op's median
over its rounds, the op/bw column against that state's median read. Use many short rounds (e.g.
--rounds 40 --tokens 24).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from tritium.backend.engine import LLMEngine
from tritium.backend.models.native_step import NativeStep
from tritium.backend.sampling_params import SamplingParams
from tritium.client.bench.native_step_bench import PROMPT, read_bandwidth_gbs
from tritium.kernels.decode_layer import PROFILE_OPS, read_profile_threads
from tritium.kernels.decode_step import read_step_profile

ENV = "TRITIUM_STEP_PROFILE"

_LIN = {"qkv": "qkv", "o": "o", "gate_up": "gate_up", "down": "down"}


def _tensor_bytes(obj) -> int:
    """Bytes of the tensors a packed linear holds (codes, scales, zeros, ...)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(_tensor_bytes(o) for o in obj)
    if hasattr(obj, "__dataclass_fields__"):
        return sum(_tensor_bytes(getattr(obj, f)) for f in obj.__dataclass_fields__)
    return 0


def linear_bytes(model) -> dict:
    """Weight bytes per linear kind (qkv, o, gate_up, down) over all layers."""
    from tritium.backend.models.native_step import _packed
    out = {k: 0 for k in _LIN}
    names = {"qkv": "qkv_proj", "o": "o_proj", "gate_up": "gate_up_proj", "down": "down_proj"}
    for layer in model.layers:
        for k, name in names.items():
            p, bias, _ = _packed(getattr(layer, name))
            out[k] += _tensor_bytes(p.tensors) + (_tensor_bytes(bias) if bias is not None else 0)
    return out


def head_bytes(model) -> int:
    head = model.lm_head if model.lm_head is not None else model.embed_tokens
    if head is None:
        return _tensor_bytes(model.packed_head)
    if hasattr(head, "_get_packed"):
        return _tensor_bytes(head._get_packed().tensors)
    return _tensor_bytes(head.weight)


def profile(eng: LLMEngine, tokens: int, batch: int, wall: bool = False) -> dict:
    """One round: per-op seconds per step (the native ops, head, the whole step)."""
    clock = time.perf_counter if wall else time.thread_time
    step_clock = time.perf_counter if wall else (lambda: time.process_time() / torch.get_num_threads())
    model = eng.runner.model
    head_s = [0.0]
    logits = model.compute_logits

    def timed(h):
        t = clock()
        out = logits(h)
        head_s[0] += clock() - t
        return out

    model.compute_logits = timed
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        eng.add_request(f"p{time.monotonic_ns()}-{i}", prompt=PROMPT, params=params)
    eng.step()
    read_profile_threads()
    read_step_profile()
    head_s[0], steps, t0 = 0.0, 0, step_clock()
    while eng.has_unfinished():
        eng.step()
        steps += 1
    elapsed = step_clock() - t0
    per_thread, native_steps = read_profile_threads()
    ops = per_thread[0]
    whole = read_step_profile()  # the whole-step call's lookup + final norm, and its head + argmax
    del model.compute_logits
    if native_steps != steps:
        raise SystemExit(f"the native step ran {native_steps} of {steps} steps (TRITIUM_STEP_PROFILE set late, or "
                         f"refused: {model.__dict__.get('native_step_refusal')})")
    out = {op: s / steps for op, s in ops.items()}
    out.update({("t1", op): s / steps for op, s in per_thread[1].items()})
    out["lookup and final norm"] = whole["lookup and final norm"] / steps
    out["head"] = (head_s[0] + whole["head"]) / steps
    out["step"] = elapsed / steps
    out["python and sampling"] = (out["step"] - out["head"] - out["lookup and final norm"]
                                  - sum(ops.values()) / steps)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("engine")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--bandwidth-gbs", type=float, default=None)
    p.add_argument("--wall", action="store_true", help="wall-clock times (default: CPU time)")
    p.add_argument("--state-gbs", type=float, default=None,
                   help="split rounds by the same-second 2-thread read at this many GB/s (fast / slow)")
    args = p.parse_args(argv)
    if args.tokens < 2 or args.rounds < 1 or args.batch < 1 or args.threads < 1:
        p.error("--tokens must be >= 2, --rounds, --batch and --threads >= 1")
    if args.state_gbs is not None and not args.state_gbs > 0:
        p.error(f"--state-gbs must be > 0, got {args.state_gbs}")
    saved, threads = os.environ.get(ENV), torch.get_num_threads()
    os.environ[ENV] = "wall" if args.wall else "1"
    torch.set_num_threads(args.threads)
    try:
        return _main(args)
    finally:
        torch.set_num_threads(threads)
        if saved is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = saved


def _main(args) -> int:
    # the weights lie on 2 MiB pages (native_step.weights_to_huge_pages) unless TRITIUM_HUGE_PAGES=0
    bw = args.bandwidth_gbs or read_bandwidth_gbs(huge=True) or read_bandwidth_gbs()
    eng = LLMEngine(args.engine, enable_prefix_caching=False, max_decode_burst=1)  # one step a call: per-step figures
    profile(eng, 4, args.batch)  # warm-up, and NativeStep.get decides
    model = eng.runner.model
    if NativeStep.get(model) is None:
        raise SystemExit(f"no native step: {model.__dict__.get('native_step_refusal')}")
    lin, m = linear_bytes(model), model.cfg.model
    ctx = len(eng.tokenizer.encode(PROMPT)) + args.tokens / 2 if hasattr(eng, "tokenizer") else args.tokens
    kv = int(args.batch * ctx * m.num_kv_heads * m.head_dim * 2 * 2 * len(model.layers))
    nbytes = dict(lin, attention=kv, head=head_bytes(model))
    huge = NativeStep.get(model).huge_page_bytes
    name = os.path.basename(args.engine.rstrip('/'))
    if args.state_gbs is None:
        best = min((profile(eng, args.tokens, args.batch, args.wall) for _ in range(args.rounds)),
                   key=lambda r: r["step"])
        _table(f"{name}: batch {args.batch}, {args.tokens} tokens, best of {args.rounds}, {args.threads} thread(s), "
               f"read bandwidth {bw:.1f} GB/s; {1 / best['step']:.1f} steps/s; weights on 2 MiB pages "
               f"{huge / 1e6:.0f} MB", best, nbytes, bw, args.threads)
        return 0
    probe = read_probe()
    states = {"fast": [], "slow": [], "contended": []}
    g = args.state_gbs
    for _ in range(args.rounds):
        b0 = probe()
        r = profile(eng, args.tokens, args.batch, args.wall)
        b1 = probe()
        lo, hi = min(b0, b1), max(b0, b1)
        state = "fast" if lo >= g else "slow" if hi < g and lo >= g / 2 else "contended" if lo < g / 2 else None
        if state:
            states[state].append(((b0 + b1) / 2, r))
    for state, rounds in states.items():
        if not rounds:
            print(f"{name}: no {state} round (state split at {args.state_gbs:g} GB/s)")
            continue
        sbw = statistics.median(b for b, _ in rounds)
        med = {k: statistics.median(r[k] for _, r in rounds) for k in rounds[0][1]}
        rule = {"fast": f">= {g:g}", "slow": f"in [{g / 2:g}, {g:g})", "contended": f"< {g / 2:g}"}[state]
        _table(f"{name}: {state} state (2-thread reads {rule} GB/s)", med, nbytes, sbw, args.threads,
               f"batch {args.batch}, {args.tokens} tokens, median of {len(rounds)} of {args.rounds} rounds, "
               f"{args.threads} thread(s), same-second read {sbw:.1f} GB/s; {1 / med['step']:.1f} steps/s")
    return 0


def read_probe():
    """A function returning the 2-thread (torch's threads) read rate of 128 MiB on 2 MiB pages, GB/s."""
    from tritium.kernels import hugepages
    n = 128 * (1 << 20) // 4
    buf = hugepages.to_huge_pages([torch.ones(n)])[0]

    def probe() -> float:
        best = 0.0
        for _ in range(2):
            t = time.perf_counter()
            buf.sum()
            best = max(best, n * 4 / (time.perf_counter() - t) / 1e9)
        return best
    return probe


def _table(title: str, r: dict, nbytes: dict, bw: float, threads: int, sub: str = "") -> None:
    print(title + (f"\n  {sub}" if sub else ""))
    two = threads > 1
    print(f"{'op':22s} {'ms/step':>8s} {'share':>6s} {'MB read':>8s} {'ms at bw':>8s} {'op/bw':>6s}"
          + (f" {'thread 1':>8s}" if two else ""))
    for op in PROFILE_OPS + ("lookup and final norm", "head", "python and sampling", "step"):
        ms = r[op] * 1e3
        b = nbytes.get(op)
        at = b / bw / 1e6 if b else None
        t1 = r.get(("t1", op))
        print(f"{op:22s} {ms:8.3f} {r[op] / r['step']:6.1%} "
              f"{(f'{b / 1e6:8.2f}' if b else '       -')} {(f'{at:8.3f}' if at else '       -')} "
              f"{(f'{ms / at:6.2f}' if at else '     -')}" + (f" {t1 * 1e3:8.3f}" if two and t1 is not None else ""))
    total = sum(nbytes.values())
    print(f"bytes per step {total / 1e6:.1f} MB: limit {bw * 1e9 / total:.1f} steps/s at {bw:.1f} GB/s")


if __name__ == "__main__":
    raise SystemExit(main())
