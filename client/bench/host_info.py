"""What the benchmark ran on: CPU model, the native-kernel ISA path taken, core counts and the
memory bandwidth measured here with the benchmark's thread count, for `tritium bench` and
`tritium compare` (printed first, and under "host" in their JSON reports).

Memory bandwidth: a float32 buffer of --bandwidth-mb (default 256 MB, well past any L3 cache) is
read (a sum) and copied (read + write) with torch on `threads` threads; the best of a few passes,
in GB/s (1e9 bytes). The read is measured twice: on torch's allocation (4 KiB pages where the
kernel's transparent huge pages are `madvise`, Linux's default) and on one buffer advised for
2 MiB pages (kernels/hugepages.py, where the native decode step keeps its weights); a core reads
about 1.5x faster on the latter here (its prefetchers stop at every page, each 4 KiB costs a TLB
miss). `read_gbs` is the faster of the two: the host's limit, not the allocator's. Decode streams
every weight once per step, so bytes-per-token / read GB/s is a single stream's time floor, and
read GB/s / engine bytes its tokens/s limit.
"""
from __future__ import annotations

import os
import platform
import time
from typing import Optional

BANDWIDTH_MB = 256


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("model name", "Model", "Hardware")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def isa_path() -> str:
    """The native CPU path this process runs (cpu_native.isa(): avx512 / avx2 / generic / none)."""
    from tritium.kernels import cpu_native
    return cpu_native.isa()


def memory_bandwidth(threads: int, mb: int = BANDWIDTH_MB, passes: int = 3) -> dict:
    """{'read_gbs', 'read_gbs_4k', 'read_gbs_huge', 'read_pages', 'copy_gbs', 'threads', 'buffer_mb'}
    measured with torch on `threads` threads; read_gbs the faster read, read_pages its placement
    ("2MiB" / "4KiB"; read_gbs_huge None where no buffer on 2 MiB pages could be had: THP `never`,
    not Linux, TRITIUM_HUGE_PAGES=0)."""
    import torch
    if mb < 1 or threads < 1:
        raise ValueError(f"memory bandwidth: buffer MB and threads must be >= 1, got {mb} and {threads}")
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        n = mb * (1 << 20) // 4
        src = torch.ones(n, dtype=torch.float32)
        dst = torch.empty_like(src)
        read, copy = [], []
        src.sum()  # touch the pages and warm the threads
        dst.copy_(src)
        for _ in range(passes):
            t0 = time.perf_counter()
            src.sum()
            read.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            dst.copy_(src)
            copy.append(time.perf_counter() - t0)
        del dst
        huge = _huge_copy(src)
        del src
        read_huge = []
        if huge is not None:
            huge.sum()
            for _ in range(passes):
                t0 = time.perf_counter()
                huge.sum()
                read_huge.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(saved)
    nbytes = n * 4
    r4k = round(nbytes / min(read) / 1e9, 2)
    rhuge = round(nbytes / min(read_huge) / 1e9, 2) if read_huge else None
    return {"read_gbs": max(r4k, rhuge or 0.0), "read_gbs_4k": r4k, "read_gbs_huge": rhuge,
            "read_pages": "2MiB" if rhuge is not None and rhuge >= r4k else "4KiB",
            "copy_gbs": round(2 * nbytes / min(copy) / 1e9, 2), "threads": threads, "buffer_mb": mb}


def _huge_copy(src):
    """src copied into a buffer on 2 MiB pages (kernels/hugepages.py), or None where there is none."""
    from tritium.kernels import hugepages
    try:
        if not hugepages.enabled():
            return None
    except ValueError:
        return None
    moved = hugepages.to_huge_pages([src])
    return moved[0] if moved else None


def host_report(threads: int, bandwidth_mb: Optional[int] = BANDWIDTH_MB) -> dict:
    """The host as the reports record it; bandwidth_mb None or 0 skips the measurement."""
    from tritium.kernels import cpu_isa
    rep = {"cpu_model": cpu_model(), "machine": platform.machine(), "logical_cores": os.cpu_count() or 1,
           "usable_cores": usable_cores(), "isa_path": isa_path(), "isa_paths_runnable": cpu_isa.runnable(),
           "isa_forced": os.environ.get(cpu_isa.ENV) or None, "threads": threads,
           "load_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None}
    if bandwidth_mb:
        rep["memory"] = memory_bandwidth(threads, bandwidth_mb)
    return rep


def format_host(rep: dict) -> str:
    """One line: 'host: <model> (x86_64), 2 of 2 cores, ISA path avx2 (forced; runnable avx512, avx2,
    generic), memory read 27.1 GB/s, copy 19.0 GB/s (2 threads, 256 MB)'."""
    forced = " (forced by TRITIUM_CPU_ISA)" if rep.get("isa_forced") else ""
    line = (f"host: {rep['cpu_model']} ({rep['machine']}), {rep['usable_cores']} of {rep['logical_cores']} cores "
            f"usable, ISA path {rep['isa_path']}{forced} (runnable: {', '.join(rep['isa_paths_runnable'])})")
    mem = rep.get("memory")
    if mem:
        pages = (f" ({mem['read_gbs_4k']:.1f} on 4 KiB pages, {mem['read_gbs_huge']:.1f} on 2 MiB)"
                 if mem.get("read_gbs_huge") else "")
        line += (f", memory read {mem['read_gbs']:.1f} GB/s{pages}, copy {mem['copy_gbs']:.1f} GB/s "
                 f"({mem['threads']} threads, {mem['buffer_mb']} MB)")
    if rep.get("load_1min") is not None:
        line += f", load {rep['load_1min']:.1f}"
    return line


def bandwidth_limit_tok_s(read_gbs: float, bytes_per_token: int) -> Optional[float]:
    """A single stream's decode ceiling: every weight byte read once per token at read_gbs."""
    if not bytes_per_token or read_gbs <= 0:
        return None
    return read_gbs * 1e9 / bytes_per_token


def engine_weight_bytes(engine_dir: str) -> int:
    """Bytes of an engine's weights (its .safetensors files): what decode streams per token."""
    total = 0
    for root, _, files in os.walk(engine_dir):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files if f.endswith(".safetensors"))
    return total
