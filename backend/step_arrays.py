"""StepArrays: one engine step's model inputs as host arrays (ModelRunner.prepare_arrays).

Under tensor parallelism rank 0 packs them into one int64 tensor and broadcasts it
(parallel/step_message.py); every rank turns them into device tensors the same way.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np


class StepArrays(NamedTuple):
    input_ids: np.ndarray        # (T,) int64
    positions: np.ndarray        # (T,) int64
    slot_mapping: np.ndarray     # (T,) int64
    query_start_loc: np.ndarray  # (B + 1,) int32
    seq_lens: np.ndarray         # (B,) int32
    block_tables: np.ndarray     # (B, max_blocks) int32
    logit_rows: np.ndarray       # (R,) int64: rows of the flat batch that need logits
    block_copies: np.ndarray     # (C, 2) int64: (src, dst) KV blocks to copy before the step
