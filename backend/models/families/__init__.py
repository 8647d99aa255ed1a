"""Model families: per family, a short declaration of what differs from the shared blocks.

The runtime (backend/models/decoder.py) reads only ModelConfig; a family says how a Hugging Face
config.json fills the ModelConfig fields that differ from Llama's (`hf_fields`) and how its
checkpoint names the tensors (`Family` below). The builder (builder/hf_loader.py, convert.py) uses
both; a GGUF source fills an HF-style config dict and HF tensor names and goes the same way.
"""
from __future__ import annotations

from typing import Dict

from ...config import SUPPORTED_ARCHITECTURES
from .base import Family, FamilyConfigError, PRE_NORMS
from .deepseek import DEEPSEEK_V2, DEEPSEEK_V3
from .gemma import GEMMA2, GEMMA3
from .gpt_oss import GPT_OSS
from .granite import GRANITE
from .llama import LLAMA, MISTRAL, QWEN2
from .moe import MIXTRAL, OLMOE, QWEN2_MOE, QWEN3_MOE
from .olmo2 import OLMO2
from .phi3 import PHI3
from .qwen3 import QWEN3
from .smollm3 import SMOLLM3

FAMILIES: Dict[str, Family] = {f.name: f for f in (LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA2, GEMMA3, PHI3, OLMO2,
                                                    GRANITE, SMOLLM3, MIXTRAL, QWEN3_MOE, QWEN2_MOE, OLMOE,
                                                    DEEPSEEK_V2, DEEPSEEK_V3, GPT_OSS)}
# HF model_type -> family (Gemma 3's text-only checkpoints say "gemma3_text")
BY_MODEL_TYPE: Dict[str, Family] = {t: f for f in FAMILIES.values() for t in f.hf_model_types}
assert tuple(FAMILIES) == SUPPORTED_ARCHITECTURES, "config.SUPPORTED_ARCHITECTURES and FAMILIES disagree"

__all__ = ["FAMILIES", "BY_MODEL_TYPE", "Family", "FamilyConfigError", "PRE_NORMS"]
