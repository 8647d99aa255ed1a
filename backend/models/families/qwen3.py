"""Qwen3: Llama's layer plus a per-head RMSNorm on q and k before RoPE."""
from .base import Family, llama_fields

QWEN3 = Family("qwen3", ("qwen3",), hf_fields=lambda cfg: {**llama_fields(cfg), "qk_norm": "head"})
