"""Does a bandwidth probe read differently right after a served request than after a pause?
(docs/benchmarks.md, "The bandwidth share": the probe-before / probe-after asymmetry.)

Starts llama-server (the compare's Q8_0 GGUF, 2 threads) and, round after round, in a shuffled
order per round, runs each condition once:
  req+D   a single-stream request (the compare's single-stream shape), a pause of D ms, then two
          probes back to back (P1, P2)
  idle+D  no request: a pause of D ms, then P1, P2
Every probe watches llama-server and this process (cpu_watch.CpuWatch, no wait) and the host's
/proc/stat, so each reading comes with what ran during it. Prints per condition the median P1,
P2, P1/P2, the servers' and the host's cores during P1, and the stolen cores.

  python -m tritium.client.bench.probe_timing_bench [--rounds 8] [--pauses 0,50,200,1000]
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--pauses", default="0,50,200,1000", help="ms, comma list")
    ap.add_argument("--tokens", type=int, default=128, help="output tokens of each request")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    pauses = [int(x) for x in args.pauses.split(",")]
    import torch
    torch.set_num_threads(args.threads)
    from tritium.client.bench.bandwidth_probe import ReadProbe
    from tritium.client.bench.bench_openai import OpenAIDriver
    from tritium.client.bench.bench_workload import single_stream_requests
    from tritium.client.bench.cpu_watch import CpuWatch
    from tritium.client.bench.llamacpp import LlamaServer, ensure_llama_cpp
    from tritium.client.serve.server import cache_dir
    work = os.path.join(cache_dir(), "compare")
    gguf = os.path.join(work, "gguf", "SmolLM2-135M-Instruct.Q8_0.gguf")
    src = ensure_llama_cpp(None, log=lambda m: print(m, file=sys.stderr))
    probe = ReadProbe(args.threads, 128)
    llama = LlamaServer(src, gguf, parallel=1, threads=args.threads)
    conds = [f"req+{d}" for d in pauses] + [f"idle+{d}" for d in pauses]
    rows = {c: [] for c in conds}
    print(f"load {os.getloadavg()}, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}", flush=True)
    try:
        llama.start()
        probe.set_watch(CpuWatch({"llama-server": llama.proc.pid}), max_wait_s=0.0)
        drv = OpenAIDriver(llama.url)
        sess = drv.session()
        reqs = single_stream_requests(args.rounds * len(pauses) + 1, 12, args.tokens, 0, tag="pt")
        warm = sess.run(reqs[-1], "warm")
        print(f"warm-up: {warm.output_tokens} tokens in {warm.t_end - warm.t_send:.2f} s, error {warm.error}",
              file=sys.stderr, flush=True)
        k = 0
        for _ in range(args.rounds):
            order = conds[:]
            random.shuffle(order)
            for c in order:
                kind, d = c.split("+")
                if kind == "req":
                    sess.run(reqs[k], f"pt{k}")
                    k += 1
                time.sleep(int(d) / 1e3)
                p1 = probe()
                r1 = probe.last_record()
                p2 = probe()
                rows[c].append((p1, p2, r1))
                time.sleep(0.2)
            print(f"round done {time.strftime('%H:%M:%S')}", file=sys.stderr, flush=True)
        sess.close()
    finally:
        llama.stop()
    print(f"load {os.getloadavg()}, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
    print(f"{'condition':<11} {'P1 GB/s':>8} {'P2 GB/s':>8} {'P1/P2':>6} {'server':>7} {'client':>7} "
          f"{'host':>5} {'steal':>5}  (medians of {args.rounds}; cores during P1)")
    for c in conds:
        r = rows[c]
        med = lambda xs: statistics.median(xs)  # noqa: E731
        print(f"{c:<11} {med([a for a, _, _ in r]):8.1f} {med([b for _, b, _ in r]):8.1f} "
              f"{med([a / b for a, b, _ in r]):6.2f} {med([x['cores']['llama-server'] for *_, x in r]):7.3f} "
              f"{med([x['cores']['client'] for *_, x in r]):7.3f} {med([x['host']['busy'] for *_, x in r]):5.2f} "
              f"{med([x['host']['steal'] for *_, x in r]):5.2f}   P1 each: "
              + " ".join(f"{a:.0f}" for a, _, _ in r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
