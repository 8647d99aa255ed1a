"""Detokenizer CPU per token: the whole decode every step against token at a time (byte-level
BPE tokenizers, backend/byte_pieces.py), on an engine's tokenizer. A benchmark that prints figures.

    python -m tritium.client.bench.detok_bench ENGINE_DIR [--streams 16] [--lengths 128,256,1024] [--rounds 3]

Each stream is a window of the benchmark prose (bench_prose.txt) fed one token per step, as the
engine's loop thread does for every running sequence; it prints CPU microseconds per token of
add_tokens + delta for both ways, alternating round by round, and checks that both give the
same text.
"""
from __future__ import annotations

import argparse
import sys
import time

from tritium.backend.byte_pieces import token_pieces
from tritium.backend.detokenizer import IncrementalDetokenizer
from tritium.backend.loader import load_tokenizer
from tritium.client.bench.bench_workload import PROSE_FILE


def run(tok, ids, n: int, streams: int, whole: bool):
    t0 = time.process_time()
    texts = []
    for s in range(streams):
        d = IncrementalDetokenizer(tok, (), whole_decode=whole)
        out = []
        for i in ids[s:s + n]:
            d.add_tokens([i])
            out.append(d.delta(False))
        out.append(d.delta(True))
        texts.append("".join(out))
    return (time.process_time() - t0) / (streams * n), texts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("engine", help="an engine folder with tokenizer.json")
    p.add_argument("--streams", type=int, default=16, help="streams per measurement (default 16)")
    p.add_argument("--lengths", default="128,256,1024", help="tokens per stream, a comma list")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    a = p.parse_args(argv)
    try:
        lengths = [int(v) for v in a.lengths.split(",") if v]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1 or a.streams < 1 or a.rounds < 1:
        print("--lengths: a comma list of integers >= 1; --streams and --rounds >= 1", file=sys.stderr)
        return 2
    tok = load_tokenizer(a.engine)
    if tok is None:
        print(f"engine {a.engine}: no tokenizer.json", file=sys.stderr)
        return 2
    token_pieces(tok)  # the per-token byte table, built once per tokenizer (not per stream)
    with open(PROSE_FILE, encoding="utf-8") as f:
        prose = tok.encode(f.read()).ids
    print("tokens  round  whole decode us/token  token at a time us/token  ratio")
    for n in lengths:
        ids = (prose * (1 + (n + a.streams) // max(1, len(prose))))[:n + a.streams]
        for r in range(a.rounds):
            order = (True, False) if r % 2 == 0 else (False, True)
            res = {w: run(tok, ids, n, a.streams, w) for w in order}
            if res[True][1] != res[False][1]:
                print("the two ways gave different text", file=sys.stderr)
                return 1
            whole, inc = res[True][0] * 1e6, res[False][0] * 1e6
            print(f"{n:6d}  {r:5d}  {whole:21.1f}  {inc:24.1f}  {whole / inc if inc else float('inf'):5.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
