"""Does a bandwidth probe read differently right after a served request than after a pause?
(docs/benchmarks.md, "The bandwidth share": the probe-before / probe-after asymmetry.)

Starts llama-server (the compare's Q8_0 GGUF, 2 threads) and, round after round, in a shuffled
order per round, runs each condition once:
  req+D   a single-stream request (the compare's single-stream shape), a pause of D ms, then two
          probes back to back (P1, P2)
  idle+D  no request: a pause of D ms, then P1, P2
Every probe watches llama-server and this process (cpu_watch.CpuWatch, no wait) and the host's
/proc/stat, so each reading comes with what ran during it. Prints per condition the median P1,
P2, P1/P2, and the cores during P1 of the server, the client, the probe's threads (on a CPU, and
ready but waiting for one) and the host (busy, stolen).

  python -m tritium.client.bench.probe_timing_bench [--rounds 8] [--pauses 0,50,200,1000]

--contention N: no server; N busy processes (0 for none) beside the bench's probe pattern (a probe,
a 0.3 s pause as the request, the "after" probe, then the next "before" probe back to back or
after a 20 ms pause, interleaved), and each probe at nice 0 vs `--probe-nice` (needs the right
to raise priority): GB/s, before / after, and the probe's threads' cores waiting for a CPU.
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
    ap.add_argument("--contention", type=int, default=None, metavar="N",
                    help="no server: the probe pattern beside N busy processes (see the module doc)")
    ap.add_argument("--probe-nice", type=int, default=-15, help="with --contention: the other nice value")
    args = ap.parse_args(argv)
    if args.contention is not None:
        return contention(args)
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
          f"{'probe':>6} {'queued':>6} {'host':>5} {'steal':>5}  (medians of {args.rounds}; cores during P1: "
          f"the server's, the client's, the probe's threads' on a CPU and waiting for one, the host's)")
    for c in conds:
        r = rows[c]
        med = lambda xs: statistics.median(xs)  # noqa: E731
        print(f"{c:<11} {med([a for a, _, _ in r]):8.1f} {med([b for _, b, _ in r]):8.1f} "
              f"{med([a / b for a, b, _ in r]):6.2f} {med([x['cores']['llama-server'] for *_, x in r]):7.3f} "
              f"{med([x['cores']['client'] for *_, x in r]):7.3f} {med([x['cores']['probe'] for *_, x in r]):6.2f} "
              f"{med([x['probe_queued'] for *_, x in r]):6.2f} {med([x['host']['busy'] for *_, x in r]):5.2f} "
              f"{med([x['host']['steal'] for *_, x in r]):5.2f}   P1 each: "
              + " ".join(f"{a:.0f}" for a, _, _ in r))
    return 0


def contention(args) -> int:
    import subprocess

    import torch
    torch.set_num_threads(args.threads)
    from tritium.client.bench.bandwidth_probe import ReadProbe
    from tritium.client.bench.cpu_watch import CpuWatch
    probe = ReadProbe(args.threads, 128)
    probe.set_watch(CpuWatch({}), max_wait_s=0.0)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.contention)]
    conds = [(gap, nice) for gap in (0.0, 0.02) for nice in (0, args.probe_nice)]
    rows = {c: [] for c in conds}
    print(f"{args.contention} busy processes; load {os.getloadavg()}, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
    try:
        time.sleep(1.0)
        for _ in range(args.rounds):
            order = conds[:]
            random.shuffle(order)
            for gap, nice in order:
                for t in probe.own_tids:
                    os.setpriority(os.PRIO_PROCESS, t, nice)
                probe()
                time.sleep(0.3)  # the request
                after = probe()
                ra = probe.last_record()
                time.sleep(gap)
                before = probe()
                rows[(gap, nice)].append((before / after, after, ra["probe_queued"], before,
                                          probe.last_record()["probe_queued"]))
    finally:
        for h in hogs:
            h.kill()
            h.wait()
        for t in probe.own_tids:
            os.setpriority(os.PRIO_PROCESS, t, 0)
    print(f"load {os.getloadavg()}, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
    med = statistics.median
    for (gap, nice), r in rows.items():
        print(f"next probe {'back to back' if not gap else f'{gap * 1e3:.0f} ms later':>12}, nice {nice:>3}: "
              f"before / after median {med([x[0] for x in r]):.2f} (min {min(x[0] for x in r):.2f} max "
              f"{max(x[0] for x in r):.2f}); after {med([x[1] for x in r]):.1f} GB/s (threads waiting "
              f"{med([x[2] for x in r]):.2f} cores), before {med([x[3] for x in r]):.1f} GB/s (waiting "
              f"{med([x[4] for x in r]):.2f}); n={len(r)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
