"""Typed access to a GGUF file's metadata for the config translation (builder/gguf_config.py)."""
from __future__ import annotations

from typing import Callable

import numpy as np

from .convert import CheckpointError


def f32(x) -> float:
    """A float stored as float32 in the GGUF, read back as the shortest decimal that rounds to it
    (1e-06, not 9.99999997e-07), which is what the HF config.json held before conversion."""
    return float(repr(np.float32(x)).replace("np.float32(", "").rstrip(")"))


class Meta:
    """Typed access to one file's metadata; every error names the key and the value."""

    def __init__(self, field: Callable, arch: str, path: str):
        self.field, self.arch, self.path = field, arch, path

    def get(self, key: str, default=None, kind=None):
        full = key if key.startswith(("general.", "tokenizer.")) else f"{self.arch}.{key}"
        v = self.field(full)
        if v is None:
            return default
        if kind is int:
            if isinstance(v, (list, tuple)):
                raise CheckpointError(f"{self.path}: metadata {full} = {list(v)[:8]} (per-layer values) is not "
                                      f"supported; a single integer is")
            return int(v)
        if kind is float:
            return f32(v)
        return v

    def req(self, key: str, kind=int):
        v = self.get(key, kind=kind)
        if v is None:
            raise CheckpointError(f"{self.path}: required metadata {self.arch}.{key} is missing")
        return v
