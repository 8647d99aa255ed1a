"""Source-grid-aware int4 group sizes.

A GGUF that stores a linear block-quantized (Q4_0, Q4_1, Q8_0: blocks of 32 along the input
dim) gives a float engine whose weights already lie on a per-block grid. Re-quantizing them
onto groups of another size mixes two blocks per group and loses accuracy; groups equal to the
source blocks land on the source grid itself (for Q4_1, whose w = d * q + m with codes 0..15
spanning each block's [min, max], min/max RTN reproduces it). So, unless the user passed
--group-size, an int4 build of such a layer uses the source's block size.
"""
from __future__ import annotations

import os
from typing import Dict, Optional, Tuple

from .quant.quantize_int4 import SUPPORTED_GROUP_SIZES, choose_group_size

# Engine linear -> the Hugging Face tensors fused into it (the fusion of
# convert.hf_to_engine_tensors; GGUFCheckpoint maps HF names to GGUF names).
LINEAR_SOURCES = {
    "qkv_proj": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "o_proj": ("self_attn.o_proj.weight",),
    "gate_up_proj": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "down_proj": ("mlp.down_proj.weight",),
}

SourceBlock = Tuple[str, int]  # (GGUF type name(s), block size along K)


def is_gguf(source: Optional[str]) -> bool:
    return bool(source) and os.path.isfile(source) and source.lower().endswith(".gguf")


def linear_source_blocks(source: Optional[str], num_layers: int) -> Dict[str, SourceBlock]:
    """Engine linear name ('layers.3.qkv_proj') -> (type, block) for every linear of a GGUF
    source whose parts are all block-quantized with one block size; {} for other sources.
    A fused linear with a float part, or parts of different block sizes, is left out."""
    if not is_gguf(source):
        return {}
    from .gguf_loader import GGUFCheckpoint
    ckpt = GGUFCheckpoint(source)
    out: Dict[str, SourceBlock] = {}
    for i in range(num_layers):
        for lin, parts in LINEAR_SOURCES.items():
            blocks = [ckpt.block_quant(f"model.layers.{i}.{p}") for p in parts]
            if any(b is None for b in blocks) or len({b[1] for b in blocks}) != 1:
                continue
            types = "/".join(sorted({b[0] for b in blocks}))
            out[f"layers.{i}.{lin}"] = (types, blocks[0][1])
    return out


def plan_group_size(in_features: int, requested: int, is_explicit: bool,
                    source: Optional[SourceBlock]) -> Tuple[Optional[int], str]:
    """(group size or None if nothing fits, reason) for one int4 linear.

    An explicit --group-size always wins (falling back to 64/32 if it does not divide K); else
    the source's block size if it is a supported group size dividing K; else the default rule
    (128, falling back to 64/32)."""
    prefix = ""
    if not is_explicit and source is not None:
        types, block = source
        if block in SUPPORTED_GROUP_SIZES and in_features % block == 0:
            return block, f"source {types} blocks of {block}"
        prefix = f"source {types} blocks of {block} do not fit K={in_features}; "
    g = choose_group_size(in_features, requested)
    flag = "--group-size " if is_explicit else "default "
    if g == requested:
        return g, f"{prefix}{flag}{requested}"
    return g, f"{prefix}{flag}{requested} does not divide {in_features} -> {g}"


def source_tensor_block(source: Optional[str], engine_name: str) -> Optional[SourceBlock]:
    """(type, block) of the embedding ('embed_tokens') or untied LM head ('lm_head') in a GGUF
    source, None when it is stored float or the source is not a GGUF."""
    if not is_gguf(source):
        return None
    from .gguf_loader import GGUFCheckpoint
    hf = {"embed_tokens": "model.embed_tokens.weight", "lm_head": "lm_head.weight"}[engine_name]
    return GGUFCheckpoint(source).block_quant(hf)
