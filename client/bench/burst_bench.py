"""In-process single-stream decode with decode bursts off and on (backend/decode_burst.py), the
maximum bursts interleaved in one process (TRITIUM_DECODE_BURST set per request), each request
between two same-second reads of the host's memory (bandwidth_probe.ReadProbe): tok/s and the
bandwidth share (tok/s x weight bytes / the mean of the two reads), medians over all rounds and
per host state (split at --state-gbs), and the ratio of each maximum's median to the first's.
Every run's tokens must equal the first's (bursts change no bits).

    python -m tritium.client.bench.burst_bench ENGINE_DIR [--bursts 1,4,8,16] [--rounds 8] [--tokens 128]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

from tritium.backend.decode_burst import ENV

PROMPT = "The history of the old mill by the river, as the miller's daughter told it:"


def run(engine_dir: str, bursts, rounds: int, tokens: int, threads: int, state_gbs: float) -> dict:
    """{burst: [(tok/s, read GB/s, share)]} of `rounds` requests of `tokens` tokens per maximum burst,
    the order reversed every other round."""
    import torch

    from tritium.backend.engine import LLMEngine
    from tritium.backend.sampling_params import SamplingParams
    from tritium.client.bench.bandwidth_probe import ReadProbe
    from tritium.client.bench.host_info import engine_weight_bytes
    torch.set_num_threads(threads)
    eng = LLMEngine(engine_dir)
    weight_bytes = engine_weight_bytes(engine_dir)
    probe = ReadProbe(threads, 128)
    prompt = eng.tokenizer.encode(PROMPT).ids
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    saved = os.environ.get(ENV)
    out, ref = {k: [] for k in bursts}, None
    try:
        for k in bursts:  # warm-up: every path once
            os.environ[ENV] = str(k)
            eng.generate(prompt_token_ids=[prompt], params=SamplingParams(max_tokens=16, temperature=0.0,
                                                                          ignore_eos=True))
        for r in range(rounds):
            for k in (bursts if r % 2 == 0 else bursts[::-1]):
                os.environ[ENV] = str(k)
                before = probe()
                t0 = time.perf_counter()
                ids = eng.generate(prompt_token_ids=[prompt], params=params)[0].outputs[0].token_ids
                seconds = time.perf_counter() - t0
                after = probe()
                ref = ids if ref is None else ref
                if ids != ref:
                    raise AssertionError(f"burst {k} changed the tokens")
                tok_s, gbs = tokens / seconds, (before + after) / 2
                out[k].append((tok_s, gbs, tok_s * weight_bytes / (gbs * 1e9)))
    finally:
        if saved is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = saved
    print(f"{engine_dir}: {weight_bytes / 1e6:.1f} MB of weights, {rounds} rounds x {tokens} tokens, "
          f"{threads} threads; state split at {state_gbs} GB/s")
    first = statistics.median(x[0] for x in out[bursts[0]])
    for k in bursts:
        rows = out[k]
        line = f"max burst {k:>3}: {statistics.median(x[0] for x in rows):7.1f} tok/s " \
               f"({statistics.median(x[0] for x in rows) / first:.3f}x), share {100 * statistics.median(x[2] for x in rows):5.1f} %"
        for label, part in (("slow", [x for x in rows if x[1] < state_gbs]),
                            ("fast", [x for x in rows if x[1] >= state_gbs])):
            if part:
                line += f" | {label} n={len(part)}: {statistics.median(x[0] for x in part):7.1f} tok/s " \
                        f"{100 * statistics.median(x[2] for x in part):5.1f} % of {statistics.median(x[1] for x in part):.0f} GB/s"
        print(line)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("engine_dir")
    p.add_argument("--bursts", default="1,4,8,16", help="maximum bursts, the first the baseline (default 1,4,8,16)")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--state-gbs", type=float, default=48.0, help="read rate splitting slow / fast host states")
    a = p.parse_args(argv)
    bursts = [int(x) for x in a.bursts.split(",")]
    if a.rounds < 1 or a.tokens < 1 or not bursts or any(not 1 <= k <= 256 for k in bursts):
        p.error("--rounds and --tokens must be >= 1 and --bursts integers in [1, 256]")
    run(a.engine_dir, bursts, a.rounds, a.tokens, a.threads, a.state_gbs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
