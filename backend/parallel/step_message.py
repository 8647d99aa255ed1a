"""One engine step's inputs packed into a single int64 tensor, for rank 0's broadcast.

Header (HEADER_LEN int64): op, T tokens, B sequences, max blocks per sequence, R logit rows,
C block copies, L (1 when the step has LoRA rows). Payload: input_ids (T), positions (T),
slot_mapping (T), query_start_loc (B+1), seq_lens (B), block_tables (B * max_blocks),
logit_rows (R), block_copies (2C), then with L each row's LoRA device slot (T, -1 for the base).
OP_LORA_INIT (max_loras, max_lora_rank) turns LoRA on in the workers; OP_LORA_LOAD (slot, M
modules, V values) is followed by an int64 table (M, 3) and V float32 values (backend/lora/tp.py).
Plain integers and floats only: nothing is pickled between the processes.
"""
from __future__ import annotations

import numpy as np
import torch

from ..step_arrays import StepArrays

HEADER_LEN = 8
OP_STEP, OP_NOP, OP_STOP, OP_LORA_INIT, OP_LORA_LOAD = 1, 2, 3, 4, 5


def header(op: int, a: StepArrays = None, lora_rows: bool = False, values=()) -> torch.Tensor:
    """A step's header (op OP_STEP and its arrays), or op with up to 7 integer `values`."""
    h = torch.zeros(HEADER_LEN, dtype=torch.int64)
    h[0] = op
    if a is not None:
        b, mb = a.block_tables.shape
        h[1:7] = torch.tensor([len(a.input_ids), b, mb, len(a.logit_rows), len(a.block_copies), int(lora_rows)])
    for i, v in enumerate(values):
        h[1 + i] = int(v)
    return h


def pack(a: StepArrays, lora_rows=None) -> torch.Tensor:
    extra = [] if lora_rows is None else [np.asarray(lora_rows, dtype=np.int64)]
    return torch.from_numpy(np.concatenate([
        a.input_ids, a.positions, a.slot_mapping, a.query_start_loc.astype(np.int64),
        a.seq_lens.astype(np.int64), a.block_tables.astype(np.int64).ravel(), a.logit_rows,
        a.block_copies.ravel()] + extra).astype(np.int64, copy=False))


def payload_len(h: torch.Tensor) -> int:
    t, b, mb, r, c, lora = (int(x) for x in h[1:7])
    return 3 * t + (b + 1) + b + b * mb + r + 2 * c + lora * t


def lora_rows(h: torch.Tensor, payload: torch.Tensor):
    """The step's rows' LoRA slots (None for the base model), or None when the step has no LoRA rows."""
    if not int(h[6]):
        return None
    t = int(h[1])
    return [None if s < 0 else s for s in payload[-t:].tolist()]


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
