"""Packed weights on 2 MiB pages: one buffer for a model's decode-time weights, advised for
transparent huge pages before it is written.

A decode step streams every weight once. On 4 KiB pages a core's hardware prefetchers stop at
every page boundary and every 4 KiB costs a TLB miss, so a one-row GEMV reads its weights at about
two thirds of the speed it reaches on 2 MiB pages (client/bench/gemv_bench.py --huge-pages).
Linux's default THP mode (`madvise`) gives huge pages only to memory that asks for them, and
torch's allocator does not ask; so `empty_views` / `to_huge_pages` lay tensors out in one 2 MiB-
aligned buffer, `madvise(MADV_HUGEPAGE)` before it is written, and return views of it (the caller
swaps them in; the old tensors are freed when nothing else holds them). Values, shapes and dtypes are unchanged:
only where the bytes live.

TRITIUM_HUGE_PAGES: unset or 1 on, 0 off (the weights stay where they are). Elsewhere than
Linux, or where madvise refuses (THP `never`), nothing is moved.
"""
from __future__ import annotations

import ctypes
import os
import sys
from typing import List, Optional, Sequence, Tuple

import torch

ENV = "TRITIUM_HUGE_PAGES"
HUGE = 2 << 20
ALIGN = 64  # each tensor starts on a cache line
_MADV_HUGEPAGE = 14


def enabled() -> bool:
    """TRITIUM_HUGE_PAGES: unset or 1 on, 0 off; anything else is an error naming the values."""
    v = os.environ.get(ENV, "1").strip().lower()
    if v not in ("0", "1", "false", "true", "off", "on"):
        raise ValueError(f"{ENV}={os.environ.get(ENV)!r}; allowed: 1 (default), 0")
    return v in ("1", "true", "on")


def thp_mode() -> Optional[str]:
    """The kernel's transparent huge page mode (always / madvise / never), None where it does not say."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")] if "[" in text and "]" in text else None


def _madvise_huge(addr: int, length: int) -> bool:
    if not sys.platform.startswith("linux") or thp_mode() == "never":
        return False  # THP never: madvise still says yes, but no page would be huge
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return False
    fn = libc.madvise
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn(addr, length, _MADV_HUGEPAGE) == 0


def empty_views(specs: Sequence[Tuple[torch.Size, torch.dtype]]) -> Optional[List[torch.Tensor]]:
    """Uninitialised contiguous tensors of the given (shape, dtype)s, in order in one buffer advised
    for 2 MiB pages, each starting on a 64-byte boundary; None where off (TRITIUM_HUGE_PAGES=0), not
    Linux, madvise refused, or no specs. The views keep the buffer alive; its pages are taken as
    they are first written, so a caller that fills one view, then drops the tensor it copied,
    holds about one copy of the weights at any time, not two."""
    if not specs or not enabled():
        return None
    offsets, total = [], 0
    for shape, dtype in specs:
        offsets.append(total)
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        total += (n + ALIGN - 1) // ALIGN * ALIGN
    span = (total + HUGE - 1) // HUGE * HUGE
    buf = torch.empty(span + HUGE, dtype=torch.uint8)  # large: mapped, not yet touched
    start = (-buf.data_ptr()) % HUGE
    if not _madvise_huge(buf.data_ptr() + start, span):
        return None
    out = []
    for (shape, dtype), off in zip(specs, offsets):
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        out.append(buf[start + off:start + off + n].view(dtype).view(shape))
    return out


def to_huge_pages(tensors: Sequence[torch.Tensor]) -> Optional[List[torch.Tensor]]:
    """Copies of `tensors` (CPU) in one buffer advised for 2 MiB pages (empty_views); None where
    empty_views gives none."""
    if any(t.device.type != "cpu" for t in tensors):
        raise ValueError("to_huge_pages: CPU tensors only")
    out = empty_views([(t.shape, t.dtype) for t in tensors])
    if out is not None:
        for v, t in zip(out, tensors):
            v.copy_(t)
    return out


def huge_page_bytes() -> Optional[int]:
    """This process's anonymous memory on transparent huge pages (AnonHugePages of
    /proc/self/smaps_rollup), or None where the kernel does not say."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
