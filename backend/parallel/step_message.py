"""One engine step's inputs packed into a single int64 tensor, for rank 0's broadcast.

Header (HEADER_LEN int64): op, T tokens, B sequences, max blocks per sequence, R logit rows,
C block copies. Payload: input_ids (T), positions (T), slot_mapping (T), query_start_loc (B+1),
seq_lens (B), block_tables (B * max_blocks), logit_rows (R), block_copies (2C). Plain integers
only: nothing is pickled between the processes.
"""
from __future__ import annotations

import numpy as np
import torch

from ..step_arrays import StepArrays

HEADER_LEN = 8
OP_STEP, OP_NOP, OP_STOP = 1, 2, 3


def header(op: int, a: StepArrays = None) -> torch.Tensor:
    h = torch.zeros(HEADER_LEN, dtype=torch.int64)
    h[0] = op
    if a is not None:
        b, mb = a.block_tables.shape
        h[1:6] = torch.tensor([len(a.input_ids), b, mb, len(a.logit_rows), len(a.block_copies)])
    return h


def pack(a: StepArrays) -> torch.Tensor:
    return torch.from_numpy(np.concatenate([
        a.input_ids, a.positions, a.slot_mapping, a.query_start_loc.astype(np.int64),
        a.seq_lens.astype(np.int64), a.block_tables.astype(np.int64).ravel(), a.logit_rows,
        a.block_copies.ravel()]).astype(np.int64, copy=False))


def payload_len(h: torch.Tensor) -> int:
    t, b, mb, r, c = (int(x) for x in h[1:6])
    return 3 * t + (b + 1) + b + b * mb + r + 2 * c


def unpack(h: torch.Tensor, payload: torch.Tensor) -> StepArrays:
    t, b, mb, r, c = (int(x) for x in h[1:6])
    p = payload.numpy()
    out, i = [], 0
    for n in (t, t, t, b + 1, b, b * mb, r, 2 * c):
        out.append(p[i:i + n])
        i += n
    ids, pos, slots, qsl, seq_lens, tables, rows, copies = out
    return StepArrays(ids.copy(), pos.copy(), slots.copy(), qsl.astype(np.int32), seq_lens.astype(np.int32),
                      tables.astype(np.int32).reshape(b, mb), rows.copy(), copies.reshape(c, 2).copy())
