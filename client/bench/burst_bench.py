"""In-process single-stream decode with decode bursts off and on (backend/decode_burst.py), the
maximum bursts interleaved in one process (TRITIUM_DECODE_BURST set per request), each request
between two same-second reads of the host's memory (bandwidth_probe.ReadProbe): tok/s and the
bandwidth share (tok/s x weight bytes / the mean of the two reads), medians over all rounds and
per host state (split at --state-gbs), and the ratio of each maximum's median to the first's.
Every run's tokens must equal the first's (bursts change no bits).

    python -m tritium.client.bench.burst_bench ENGINE_DIR [--bursts 1,4,8,16] [--rounds 8] [--tokens 128]
        [--served WORK_DIR]   # through tritonserver: one model per maximum burst, HTTP generate_stream
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
    _report(engine_dir, out, bursts, weight_bytes, rounds, tokens, threads, state_gbs)
    return out


def run_served(engine_dir: str, bursts, rounds: int, tokens: int, threads: int, state_gbs: float,
               work_dir: str) -> dict:
    """The same through a real tritonserver: one model per maximum burst on the same engine (model
    parameter max_decode_burst), single streams over Triton's HTTP generate_stream sent to each in
    turn (the order reversed every other round), each between two same-second reads."""
    import json
    import urllib.request

    from tritium.builder.repository import llm_config
    from tritium.client.bench.bandwidth_probe import ReadProbe
    from tritium.client.bench.host_info import engine_weight_bytes
    from tritium.client.serve.server import TritonServer
    repo = os.path.join(work_dir, "repo")
    names = [f"burst{k}" for k in bursts]
    for name, k in zip(names, bursts):
        os.makedirs(os.path.join(repo, name, "1"), exist_ok=True)
        with open(os.path.join(repo, name, "config.pbtxt"), "w") as f:
            f.write(llm_config(name, os.path.abspath(engine_dir), 16, {"max_decode_burst": str(k)}))
    saved = os.environ.pop(ENV, None)
    srv = TritonServer(repo, log_file=os.path.join(work_dir, "server.log"), load_models=names)
    try:
        srv.start(timeout=300)
        weight_bytes = engine_weight_bytes(engine_dir)
        probe = ReadProbe(threads, 128)

        def request(name: str, n: int) -> list:
            body = json.dumps({"text_input": PROMPT, "max_tokens": n, "stream": True, "temperature": 0.0,
                               "sampling_parameters": '{"ignore_eos": true}'}).encode()
            ids = []
            req = urllib.request.Request(f"http://{srv.http_url}/v2/models/{name}/generate_stream", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=300) as r:
                for line in r:
                    if line.startswith(b"data:"):
                        v = json.loads(line[5:]).get("output_ids")
                        ids += v if isinstance(v, list) else [] if v is None else [v]
            return ids
        for name in names:
            request(name, 16)  # warm-up
        out, ref = {k: [] for k in bursts}, None
        for r in range(rounds):
            for k, name in (list(zip(bursts, names)) if r % 2 == 0 else list(zip(bursts, names))[::-1]):
                before = probe()
                t0 = time.perf_counter()
                ids = request(name, tokens)
                seconds = time.perf_counter() - t0
                after = probe()
                ref = ids if ref is None else ref
                if ids != ref or len(ids) != tokens:
                    raise AssertionError(f"burst {k}: the served tokens differ")
                tok_s, gbs = tokens / seconds, (before + after) / 2
                out[k].append((tok_s, gbs, tok_s * weight_bytes / (gbs * 1e9)))
    finally:
        srv.stop()
        if saved is not None:
            os.environ[ENV] = saved
    _report(f"{engine_dir} served (HTTP generate_stream)", out, bursts, weight_bytes, rounds, tokens, threads,
            state_gbs)
    return out


def _report(what, out, bursts, weight_bytes, rounds, tokens, threads, state_gbs) -> None:
    print(f"{what}: {weight_bytes / 1e6:.1f} MB of weights, {rounds} rounds x {tokens} tokens, "
          f"{threads} threads; state split at {state_gbs} GB/s")
    med = statistics.median
    first = med(x[0] for x in out[bursts[0]])
    for k in bursts:
        rows = out[k]
        tok_s = med(x[0] for x in rows)
        line = f"max burst {k:>3}: {tok_s:7.1f} tok/s ({tok_s / first:.3f}x), share {100 * med(x[2] for x in rows):5.1f} %"
        for label, part in (("slow", [x for x in rows if x[1] < state_gbs]),
                            ("fast", [x for x in rows if x[1] >= state_gbs])):
            if part:
                line += (f" | {label} n={len(part)}: {med(x[0] for x in part):7.1f} tok/s "
                         f"{100 * med(x[2] for x in part):5.1f} % of {med(x[1] for x in part):.0f} GB/s")
        print(line)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("engine_dir")
    p.add_argument("--bursts", default="1,4,8,16", help="maximum bursts, the first the baseline (default 1,4,8,16)")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--state-gbs", type=float, default=48.0, help="read rate splitting slow / fast host states")
    p.add_argument("--served", metavar="WORK_DIR", default=None,
                   help="through a real tritonserver (its repository and log under WORK_DIR): one model per "
                        "maximum burst, single streams over HTTP generate_stream")
    a = p.parse_args(argv)
    bursts = [int(x) for x in a.bursts.split(",")]
    if a.rounds < 1 or a.tokens < 1 or not bursts or any(not 1 <= k <= 256 for k in bursts):
        p.error("--rounds and --tokens must be >= 1 and --bursts integers in [1, 256]")
    if a.served:
        run_served(a.engine_dir, bursts, a.rounds, a.tokens, a.threads, a.state_gbs, a.served)
    else:
        run(a.engine_dir, bursts, a.rounds, a.tokens, a.threads, a.state_gbs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
