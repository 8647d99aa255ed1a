"""The per-linear quantization plan of a build: which format, group size and rounding order each
linear gets (from --quantization, --group-size, --exclude-modules and the source's own grid)."""
from __future__ import annotations

import fnmatch
from typing import Dict, Optional

from tritium.backend.config import EngineConfig, LayerQuant
from tritium.kernels.quant_layouts import INT4_LAYOUTS

from .quant_layers import LINEARS, linear_in_features
from .quantize_int4 import choose_group_size
from ..source_grid import linear_source_blocks, plan_group_size, source_tensor_block

DEFAULT_GROUP_SIZE = 128
PER_ROW = -1  # --group-size -1 (int8 / fp8): one scale per output channel (GPTQ's convention)


def excluded(name: str, patterns: Optional[str]) -> bool:
    """--exclude-modules: comma-separated fnmatch globs over names like 'layers.3.down_proj'."""
    return bool(patterns) and any(fnmatch.fnmatch(name, p.strip()) for p in patterns.split(",") if p.strip())


def plan_layers(cfg: EngineConfig, o) -> Dict[str, LayerQuant]:
    """Per-linear LayerQuant for every linear in the model (method 'none' when excluded).

    int4 group sizes: explicit --group-size, else the GGUF source's own block size where the
    linear is block-quantized there (source_grid.py), else 128 falling back to 64/32. The
    embedding (and an untied lm_head) per --embedding-quantization (plan_embedding)."""
    kind = {"int8": "int8", "fp8": "fp8"}.get(o.quantization, "int4")
    sym = int4_symmetric(o)
    plan = {}
    blocks = linear_source_blocks(o.source, cfg.model.num_layers) if not o.group_size_explicit else {}
    for i in range(cfg.model.num_layers):
        for lin in LINEARS:
            if lin == "qkv_proj" and cfg.model.kv_lora_rank:
                continue  # multi-head latent attention: its projections stay float (o_proj is quantized)
            name = f"layers.{i}.{lin}"
            if excluded(name, o.exclude_modules):
                plan[name] = LayerQuant("none")
                continue
            if kind != "int4":
                plan[name] = plan_8bit(kind, linear_in_features(cfg.model, lin), name, o, blocks.get(name))
                continue
            k = linear_in_features(cfg.model, lin)
            g, reason = plan_group_size(k, o.group_size, o.group_size_explicit, blocks.get(name))
            if g is None:
                raise ValueError(f"--group-size {o.group_size} fits no layer: {name} has in_features {k}, "
                                 f"not a multiple of {o.group_size}, 64 or 32")
            act_order = bool(o.act_order and o.quantization == "int4-gptq")
            on_grid = name in blocks and g == blocks[name][1]
            if act_order and not on_grid and lin == "o_proj" and o.tensor_parallel_size > 1:
                # o_proj's inputs are split by attention head, and act-order's g_idx groups mix
                # channels of every head: at tensor parallelism it uses static groups (act-order
                # column order, contiguous groups) so that each rank holds whole groups.
                plan[name] = LayerQuant("int4", group_size=g, group_reason=reason, static_groups=True, symmetric=sym)
                continue
            # On a source grid act-order's g_idx groups would mix source blocks: GPTQ there uses
            # static groups (act-order's column order, parameters fixed per source block, no g_idx).
            plan[name] = LayerQuant("int4", group_size=g, act_order=act_order and not on_grid,
                                    group_reason=reason,
                                    static_groups=act_order and on_grid, symmetric=sym)
    for name in ("embed_tokens",) + (() if cfg.model.tie_word_embeddings else ("lm_head",)):
        plan[name] = plan_embedding(kind, cfg.model.hidden_size, o, name)
    return plan


def int4_symmetric(o) -> bool:
    """--int4-layout: asymmetric (the default: a float16 scale and zero per group) or symmetric
    (llama.cpp Q4_0's grid, no zeros).
    Raises ValueError naming the flag for another value, or the flag without an int4 build."""
    layout = getattr(o, "int4_layout", None)
    if layout is not None and layout not in INT4_LAYOUTS:
        raise ValueError(f"--int4-layout {layout!r} not supported; allowed: {', '.join(INT4_LAYOUTS)}")
    if layout is not None and not (o.quantization.startswith("int4") or o.quantization == "auto"):
        raise ValueError(f"--int4-layout {layout} needs --quantization int4-rtn, int4-awq, int4-gptq or auto, "
                         f"got {o.quantization}")
    return (layout or INT4_LAYOUTS[0]) == "symmetric"


def plan_embedding(kind: str, hidden: int, o, name: str) -> LayerQuant:
    """The embedding / untied LM head of a quantized build (--embedding-quantization):
    none (or --exclude-modules matching it): float; int8: symmetric groups of 32 (8.5 bits) in
    int8 / fp8 builds, one scale per row in int4 builds (8 + 16 / hidden bits);
    int6: symmetric 6-bit codes with float16 scales per 64 (6.25 bits; per row, 6 + 16 / hidden,
    where 64 does not divide hidden), the head rounded by GPTQ in int4-gptq builds (quant_head.py);
    int4: asymmetric groups of 32 (round to nearest, 5 bits); auto: int6 in int4 builds (per-row
    int8 where hidden is not a multiple of 4, and under --quantization auto), groups of 32 in int8 / fp8 builds."""
    emb = getattr(o, "embedding_quantization", "auto") or "auto"
    if emb == "none" or excluded(name, o.exclude_modules):
        return LayerQuant("none")
    if emb == "int4":
        g = choose_group_size(hidden, EMBEDDING_GROUP_SIZE)
        if g is None:
            raise ValueError(f"--embedding-quantization int4: no group size of 32 fits hidden size {hidden}")
        return LayerQuant("int4", group_size=g, group_reason=f"--embedding-quantization int4: groups of {g}")
    if emb == "auto" and kind == "int4" and o.quantization.startswith("int4") and hidden % 4 == 0:
        emb = "int6"  # int4 builds: within the 3% budget at 0.33x the bfloat16 engine (docs/quantization.md)
    if emb == "int6":
        if hidden % 4:
            raise ValueError(f"--embedding-quantization int6: hidden size {hidden} is not a multiple of 4")
        g = INT6_GROUP_SIZE if hidden % INT6_GROUP_SIZE == 0 and hidden > INT6_GROUP_SIZE else None
        return LayerQuant("int6", group_size=g, group_reason="int6 embedding: "
                          + (f"symmetric groups of {g}" if g else "per row"))
    if kind == "int4":  # int8 (or auto without int6): one scale per row, rounded by the build's method
        return LayerQuant("int8")
    return plan_8bit_embedding(hidden, o, name, explicit_group=kind != "int4")


EMBEDDING_GROUP_SIZE = 32
INT6_GROUP_SIZE = 64  # int6 embedding: float16 scale per 64 (6.25 bits) where 64 divides hidden, else per row


def plan_8bit_embedding(hidden: int, o, name: str, explicit_group: bool = True) -> LayerQuant:
    """int8 / fp8 builds: the embedding (and an untied LM head) as int8 in symmetric groups of 32
    along the hidden dimension with float16 scales (8.5 bits per weight, the grid of llama.cpp's
    Q8_0, so a Q8_0 source is kept exactly); an explicit --group-size of an int8 / fp8 build
    (explicit_group) applies here too (-1: one scale per row); one scale per row where no group
    size divides hidden."""
    explicit = explicit_group and o.group_size_explicit
    if explicit and o.group_size == PER_ROW:
        return LayerQuant("int8", group_reason="--group-size -1: per row")
    if explicit:
        g, reason = plan_group_size(hidden, o.group_size, True, None)
        return LayerQuant("int8", group_size=g, group_reason=reason + " (symmetric)" if g else
                          f"--group-size {o.group_size} fits no group of hidden {hidden}: per row")
    if hidden % EMBEDDING_GROUP_SIZE:
        return LayerQuant("int8", group_reason=f"{EMBEDDING_GROUP_SIZE} does not divide hidden {hidden}: per row")
    block = source_tensor_block(o.source, name)
    reason = (f"source {block[0]} blocks of {block[1]} (symmetric: its own grid)"
              if block is not None and block[0] == "Q8_0" and block[1] == EMBEDDING_GROUP_SIZE
              else f"symmetric groups of {EMBEDDING_GROUP_SIZE}")
    return LayerQuant("int8", group_size=EMBEDDING_GROUP_SIZE, group_reason=reason)


def plan_8bit(kind: str, k: int, name: str, o, source) -> LayerQuant:
    """int8 / fp8: --group-size N: symmetric groups of N (64/32 where N does not divide K);
    --group-size -1: one scale per output channel; default: a linear stored block-quantized in
    a GGUF source gets asymmetric groups on the source's blocks (its grid kept exactly), any
    other one scale per output channel (docs/quantization.md has the measurements behind this)."""
    if o.group_size_explicit and o.group_size == PER_ROW:
        return LayerQuant(kind, group_reason="--group-size -1: per output channel")
    if o.group_size_explicit:
        g, reason = plan_group_size(k, o.group_size, True, None)
        if g is None:
            raise ValueError(f"--group-size {o.group_size} fits no layer: {name} has in_features {k}, "
                             f"not a multiple of {o.group_size}, 64 or 32")
        return LayerQuant(kind, group_size=g, group_reason=reason)
    if source is not None:
        g, reason = plan_group_size(k, DEFAULT_GROUP_SIZE, False, source)
        if g == source[1]:
            return LayerQuant(kind, group_size=g, group_reason=reason + " (asymmetric, source grid)",
                              asymmetric=True)
    return LayerQuant(kind)
