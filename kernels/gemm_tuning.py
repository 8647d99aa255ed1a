"""Tile configurations of the Triton GEMMs, keyed by (kernel, variant, row bucket, N, K).

Each GEMM kernel has a small config space (BLOCK_M/N/K, num_warps, num_stages, split-K). On CUDA
the launcher times every config of the space once per key (triton.testing.do_bench) and keeps
the fastest: in memory, and on disk when TRITIUM_GEMM_TUNE_CACHE names a folder (one JSON file
per GPU name and Triton version). The engine's load runs a warm-up over every row bucket of
its linears (backend/gemm_warmup.py), so nothing is timed or compiled while serving. Off CUDA
(Triton's interpreter) and with TRITIUM_GEMM_TUNE=0 each bucket has a fixed default config.
"""
from __future__ import annotations

import json
import os
import threading
from dataclasses import asdict, dataclass
from typing import Callable, Dict, Optional, Tuple

import torch

# Row buckets: the upper bound of each bucket; LARGE stands for "more than 64 rows".
LARGE = 128
ROW_BUCKETS = (1, 4, 8, 16, 32, 64, LARGE)


def row_bucket(m: int) -> int:
    """The row bucket of an M-row GEMM: 1, 2-4, 5-8, 9-16, 17-32, 33-64, >64 -> 1, 4, 8, 16, 32, 64, 128."""
    if m < 1:
        raise ValueError(f"m: the GEMM's row count must be >= 1, got {m}")
    for b in ROW_BUCKETS[:-1]:
        if m <= b:
            return b
    return LARGE


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1  # K partitions; > 1 adds a float32 partial buffer and a fixed-order reduction


_C = GemmConfig
# Weight-only W4A16 / W8A16: skinny tiles and split-K for decode, square tiles for prefill.
# BLOCK_K >= 32 everywhere: W4A16 unpacks BLOCK_K / 2 bytes per row and tl.dot wants K >= 16.
_WEIGHT_ONLY = (
    _C(16, 64, 64), _C(16, 64, 128), _C(16, 128, 64),
    _C(16, 64, 64, split_k=2), _C(16, 64, 64, split_k=4), _C(16, 64, 128, split_k=4), _C(16, 64, 64, split_k=8),
    _C(32, 64, 64), _C(32, 128, 64, split_k=2),
    _C(64, 64, 64), _C(64, 128, 64, 8),
    _C(128, 128, 64, 8, 3),
)
# FP8 W8A8: BLOCK_K >= 32 (max_num_imprecise_acc = 32 must not exceed it).
_FP8 = (
    _C(16, 64, 64), _C(16, 64, 128), _C(16, 128, 128), _C(16, 64, 128, split_k=4),
    _C(32, 64, 64), _C(32, 64, 128), _C(64, 64, 64), _C(64, 128, 64, 8), _C(64, 128, 128, 8),
    _C(128, 128, 128, 8),
)
SPACES: Dict[str, Tuple[GemmConfig, ...]] = {"w4a16": _WEIGHT_ONLY, "w8a16": _WEIGHT_ONLY, "fp8": _FP8}

# Untuned defaults per bucket (interpreter, TRITIUM_GEMM_TUNE=0): the same BLOCK_K and no split in
# every bucket, so that a row's K summation order does not depend on how many rows share the GEMM.
_BY_BUCKET = {16: _C(16, 64, 64), 32: _C(32, 64, 64), 64: _C(64, 64, 64), LARGE: _C(64, 128, 64, 8)}
_DEFAULTS = {"w4a16": _BY_BUCKET, "w8a16": _BY_BUCKET, "fp8": _BY_BUCKET}


def default_config(kernel: str, m: int) -> GemmConfig:
    """The fixed config of `kernel` for an M-row GEMM (buckets 1..16 share the skinny tile)."""
    if kernel not in SPACES:
        raise ValueError(f"kernel: one of {', '.join(SPACES)}, got {kernel!r}")
    b = row_bucket(m)
    return _DEFAULTS[kernel][max(b, 16)]


for _k, _d in _DEFAULTS.items():
    assert all(c in SPACES[_k] for c in _d.values()), _k  # defaults belong to their space


def split_ranges(k: int, block_k: int, split_k: int) -> Tuple[int, int]:
    """(effective splits, K per split): K per split is a multiple of block_k, no split is empty."""
    tiles = _cdiv(k, block_k)
    per = _cdiv(tiles, max(1, split_k)) * block_k
    return _cdiv(k, per), per


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def tuning_enabled(device: torch.device) -> bool:
    from .triton_common import is_interpreter
    return device.type == "cuda" and not is_interpreter() and os.environ.get("TRITIUM_GEMM_TUNE", "1") != "0"


Key = Tuple[str, tuple, int, int, int]


class ConfigCache:
    """Chosen configs by (kernel, variant, bucket, N, K); `visited` records every key asked for."""

    def __init__(self):
        self.chosen: Dict[Key, GemmConfig] = {}
        self.visited: set = set()
        self.lock = threading.Lock()
        self._disk_loaded = False
        # set by a `deterministic` engine's load: the bucket defaults only (one K order for
        # every batch size), for every GEMM of the process
        self.batch_invariant = False

    def _disk_path(self) -> Optional[str]:
        folder = os.environ.get("TRITIUM_GEMM_TUNE_CACHE")
        if not folder or not torch.cuda.is_available():
            return None
        name = torch.cuda.get_device_name().replace(" ", "_").replace("/", "_")
        import triton  # only on CUDA, where the cache lives: CPU-only installs need not have triton
        return os.path.join(folder, f"{name}-triton{triton.__version__}.json")

    def _load_disk(self) -> None:
        self._disk_loaded = True
        path = self._disk_path()
        if path and os.path.exists(path):
            with open(path) as f:
                for row in json.load(f):
                    key = (row["kernel"], tuple(row["variant"]), row["bucket"], row["n"], row["k"])
                    self.chosen[key] = GemmConfig(**row["config"])

    def _save_disk(self) -> None:
        path = self._disk_path()
        if not path:
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        rows = [dict(kernel=k[0], variant=list(k[1]), bucket=k[2], n=k[3], k=k[4], config=asdict(c))
                for k, c in self.chosen.items()]
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(rows, f)
        os.replace(tmp, path)

    def pick(self, kernel: str, variant: tuple, m: int, n: int, k: int, device: torch.device,
             launch: Callable[[GemmConfig], None]) -> GemmConfig:
        """The config for this GEMM: tuned on CUDA (timed once per key), the bucket default elsewhere."""
        variant = tuple(v if isinstance(v, (bool, int, str, type(None))) else str(v) for v in variant)
        key = (kernel, variant, row_bucket(m), n, k)
        with self.lock:
            self.visited.add(key)
            if self.batch_invariant or not tuning_enabled(device):
                return default_config(kernel, m)
            if not self._disk_loaded:
                self._load_disk()
            cfg = self.chosen.get(key)
            if cfg is None:
                cfg = self._tune(kernel, launch)
                self.chosen[key] = cfg
                self._save_disk()
            return cfg

    @staticmethod
    def _tune(kernel: str, launch: Callable[[GemmConfig], None]) -> GemmConfig:
        import triton.testing
        best, best_ms = None, float("inf")
        for cfg in SPACES[kernel]:
            try:
                ms = triton.testing.do_bench(lambda: launch(cfg), warmup=5, rep=20)
            except Exception:  # e.g. out of shared memory on a smaller GPU: not a candidate
                continue
            if ms < best_ms:
                best, best_ms = cfg, ms
        if best is None:
            raise RuntimeError(f"{kernel} GEMM: no config of its space launched on this GPU")
        return best


CACHE = ConfigCache()
