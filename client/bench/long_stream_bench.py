"""What a long stream's per-token bookkeeping costs as it grows: a benchmark that prints figures.

    python -m tritium.client.bench.long_stream_bench [--tokens 4096] [--at 16,256,1024,4096] [--rounds 3]

Two pieces of Python that run once per generated token beside the step, timed at stream
positions --at (microseconds, the median of the 48 tokens before each position, best of
--rounds):
- the delivery thread's response with log probs (backend/triton_backend/stream.py
  RowStream.on_output, return_log_probs on, no Tensor cache: what a log-probs stream takes), with
  a stand-in for pb_utils that keeps each response's numpy arrays (no IPC);
- the block manager's registration of a sequence's full blocks for prefix caching
  (BlockManager.cache_full_blocks, block size 16; the engine calls it for every running sequence
  every step when prefix caching is on, the server's default).
A cost that grows with the position grows quadratically over the stream. Run a tree against
another by running this file by path with the other tree first on PYTHONPATH.
"""
from __future__ import annotations

import argparse
import time
import types

from tritium.backend.block_manager import BlockManager
from tritium.backend.triton_backend.stream import RequestState, RowStream


class _Pb:
    """What RowStream uses of pb_utils: Tensors and responses kept in memory."""
    TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1

    class Tensor:
        def __init__(self, name, a):
            self.name, self.a = name, a

    class InferenceResponse:
        def __init__(self, output_tensors=(), error=None):
            self.tensors, self.error = output_tensors, error


class _Request:
    def requested_output_names(self):
        return None

    def get_response_sender(self):
        return types.SimpleNamespace(send=lambda response=None, flags=0: None)


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def log_probs_responses(tokens: int, at) -> dict:
    """{position: us} of one streamed response with log probs at each position."""
    metrics = types.SimpleNamespace(add_tokens=lambda *a: None, observe_token_times=lambda *a: None)
    engine = types.SimpleNamespace(abort=lambda rid: None)
    parsed = types.SimpleNamespace(stream=True, exclude_input_in_output=True, return_log_probs=True, prompt="hi",
                                   prompt_token_ids=None)
    row = RowStream(RequestState(_Pb, _Request(), 1, None), engine, metrics, None, 0, "r", parsed, [1, 2, 3], 1,
                    0.0, lambda r: None)
    ids, entries, times, out = [], [], [], {}
    for k in range(tokens):
        ids.append(7)
        entries.append({"token_id": 7, "logprob": -0.5, "top_logprobs": [{"token_id": 7, "logprob": -0.5}]})
        c = types.SimpleNamespace(index=0, token_ids=list(ids), new_token_ids=[7], text="", text_delta=" a",
                                  finish_reason=None, logprobs=list(entries), cum_logprob=-0.5 * len(ids))
        t = time.perf_counter()
        row.on_output(types.SimpleNamespace(outputs=[c]))
        times.append(time.perf_counter() - t)
        if k + 1 in at:
            out[k + 1] = _median(times[-48:]) * 1e6
    return out


def block_registration(tokens: int, at) -> dict:
    """{position: us} of cache_full_blocks for one decoding sequence at each position."""
    bm = BlockManager(num_blocks=tokens // 16 + 4, block_size=16)
    s = types.SimpleNamespace(token_ids=list(range(8)), num_computed_tokens=0, block_table=[], block_hashes=[])
    bm.allocate(s, 8, [])
    s.num_computed_tokens = 8
    times, out = [], {}
    for k in range(8, tokens):
        bm.append_slots(s, 1)
        s.token_ids.append(k % 500)
        s.num_computed_tokens += 1
        t = time.perf_counter()
        bm.cache_full_blocks(s)
        times.append(time.perf_counter() - t)
        if k + 1 in at:
            out[k + 1] = _median(times[-48:]) * 1e6
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--at", default="16,256,1024,4096", help="stream positions to report (comma-separated)")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    try:
        at = sorted({int(x) for x in args.at.split(",")})
    except ValueError:
        p.error(f"--at must be comma-separated integers, got {args.at!r}")
    if args.tokens < 64 or args.rounds < 1 or not at or at[0] < 16 or at[-1] > args.tokens:
        p.error("--tokens >= 64, --rounds >= 1, and every --at position in [16, --tokens]")
    for label, fn in (("response with log probs (delivery thread)", log_probs_responses),
                      ("cache_full_blocks (per sequence and step)", block_registration)):
        best = {}
        for _ in range(args.rounds):
            for pos, us in fn(args.tokens, set(at)).items():
                best[pos] = min(best.get(pos, float("inf")), us)
        print(f"{label:44s} " + "  ".join(f"token {pos}: {best[pos]:6.1f} us" for pos in at if pos in best))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
