"""A step's inputs on the device: one packed copy from pinned memory, persistent block tables.

ModelRunner.inputs turns a step's StepArrays into device tensors. On CUDA (or when forced, as
the tests do on CPU) StepBuffers does it so that the host never waits on the GPU:
- every 1-D input (ids, positions, slots, query starts, context lengths, logits rows) and the
  block-table changes are packed into one pinned int64 staging buffer and sent with a single
  non_blocking copy; the device splits and casts them;
- the block tables live on the device (PersistentTable) between steps; each step copies only the
  (row, column, block) entries that differ from the host mirror, typically one new block per
  sequence every block_size steps;
- the staging buffer is reused only after the previous step's copy finished (a CUDA event), so a
  non_blocking copy never reads memory the host is rewriting.
On CPU tensors are made with torch.from_numpy (no copy at all) unless `staged` is forced.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np
import torch

from tritium.kernels.attention_metadata import AttentionMetadata
from .step_arrays import StepArrays


@dataclass(frozen=True)
class DeviceStepOptions:
    """How ModelRunner runs a step (LLMEngine's device_sampling / cuda_graphs options).

    None means the device's default: on for CUDA, off for CPU, where the host path is faster.
    On CPU, staged / cuda_graphs run the same buffers eagerly (no pinning, no graph)."""
    device_sampling: Optional[bool] = None  # sample on the device (sampler_device.py)
    staged: Optional[bool] = None           # StepBuffers: packed pinned copy + persistent tables
    cuda_graphs: Optional[bool] = None      # static decode buffers per batch bucket (+ CUDA graphs)
    max_graph_batch: Optional[int] = None   # largest bucket (default: the engine's max batch)

    def resolve(self, device: torch.device) -> "DeviceStepOptions":
        on = device.type == "cuda"
        pick = (lambda v: on if v is None else bool(v))
        graphs = pick(self.cuda_graphs)
        return DeviceStepOptions(pick(self.device_sampling), pick(self.staged) or graphs, graphs,
                                 self.max_graph_batch)


class Stager:
    """Packs int arrays into one int64 host buffer (pinned on CUDA), one copy to the device."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pin = device.type == "cuda"
        self._host: Optional[torch.Tensor] = None
        self._event = None  # CUDA event after the last copy out of _host

    def send(self, arrays: List[np.ndarray]) -> List[torch.Tensor]:
        """1-D int arrays -> int64 device tensors (views of one device buffer)."""
        sizes = [int(a.size) for a in arrays]
        total = max(sum(sizes), 1)
        if self._event is not None:
            self._event.synchronize()  # the previous copy has long finished; this only guards reuse
        if self._host is None or self._host.numel() < total:
            self._host = torch.empty(max(total, 2 * (self._host.numel() if self._host is not None else 0)),
                                     dtype=torch.int64, pin_memory=self.pin)
        host = self._host.numpy()
        off = 0
        for a, n in zip(arrays, sizes):
            host[off:off + n] = a.reshape(-1)
            off += n
        if self.device.type == "cpu":
            dev = self._host[:total].clone()  # the CPU path keeps nothing aliased to the staging buffer
        else:
            dev = self._host[:total].to(self.device, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        out, off = [], 0
        for n in sizes:
            out.append(dev[off:off + n])
            off += n
        return out


class PersistentTable:
    """Block tables kept on the device with a host mirror; updates copy only changed entries."""

    def __init__(self, device: torch.device, rows: int, width: int, fixed: bool = False):
        self.device = device
        self.fixed = fixed  # static buffers (CUDA graphs point at them): never reallocated
        self.table = torch.zeros((rows, width), dtype=torch.int32, device=device)
        self.mirror = np.zeros((rows, width), dtype=np.int32)
        self.num_entries_copied = 0  # entries sent to the device so far (tests, stats)

    def _grow(self, rows: int, width: int) -> None:
        if self.fixed:
            raise ValueError(f"block tables of {rows} x {width} exceed the static buffer "
                             f"{tuple(self.table.shape)}")
        r, w = max(rows, self.table.shape[0]), max(width, self.table.shape[1])
        table = torch.zeros((r, w), dtype=torch.int32, device=self.device)
        table[:self.table.shape[0], :self.table.shape[1]] = self.table
        mirror = np.zeros((r, w), dtype=np.int32)
        mirror[:self.mirror.shape[0], :self.mirror.shape[1]] = self.mirror
        self.table, self.mirror = table, mirror

    def changes(self, tables: np.ndarray) -> np.ndarray:
        """(3, n) int64 (row, column, block) entries of `tables` (B, w) that differ from the
        mirror; the mirror is updated (apply() must then write them to the device)."""
        b, w = tables.shape
        if b > self.table.shape[0] or w > self.table.shape[1]:
            self._grow(b, w)
        r, c = np.nonzero(self.mirror[:b, :w] != tables)
        vals = tables[r, c]
        self.mirror[r, c] = vals
        self.num_entries_copied += int(r.size)
        return np.stack([r, c, vals]).astype(np.int64)

    def apply(self, entries: torch.Tensor) -> None:
        """Write (3, n) device entries from changes() into the device table."""
        if entries.shape[1]:
            self.table.index_put_((entries[0], entries[1]), entries[2].to(torch.int32))

    def view(self, b: int, w: int) -> torch.Tensor:
        return self.table[:b, :w]


class StepBuffers:
    """StepArrays -> device tensors through a Stager and a PersistentTable (see module doc)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stager = Stager(device)
        self.tables = PersistentTable(device, 8, 8)

    def upload(self, a: StepArrays) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                              torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (input_ids, positions, slot_mapping, query_start_loc int32, seq_lens int32,
        block_tables int32 (B, w) view of the persistent table, logit_rows int64)."""
        entries = self.tables.changes(a.block_tables)
        ids, pos, slots, qsl, lens, rows, flat = self.stager.send(
            [a.input_ids, a.positions, a.slot_mapping, a.query_start_loc, a.seq_lens, a.logit_rows, entries])
        self.tables.apply(flat.view(3, -1))
        b, w = a.block_tables.shape
        return ids, pos, slots, qsl.to(torch.int32), lens.to(torch.int32), self.tables.view(b, w), rows


def build_metadata(a: StepArrays, slot_mapping, query_start_loc, seq_lens, block_tables,
                   deterministic: bool) -> AttentionMetadata:
    """AttentionMetadata from device tensors and the host arrays' lengths (no device read)."""
    query_lens = np.diff(a.query_start_loc).tolist()
    seq_lens_cpu = a.seq_lens.tolist()
    return AttentionMetadata(slot_mapping=slot_mapping, query_start_loc=query_start_loc, seq_lens=seq_lens,
                             block_tables=block_tables, query_lens_cpu=query_lens, seq_lens_cpu=seq_lens_cpu,
                             max_query_len=max(query_lens), max_seq_len=max(seq_lens_cpu),
                             deterministic=deterministic)
