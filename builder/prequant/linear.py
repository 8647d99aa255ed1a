"""One imported linear in Tritium's terms, and the fusion of q/k/v and gate/up into one linear.

int4 is held unpacked until the end: codes uint8 (N, K) in 0..15, scales and zeros float32
(K/G, N) with w = (q - 8) * scale + zero (the engine's int4 layout), optional g_idx int32 (K,).
Zeros are float32 on purpose: a zero point z maps to zero = (8 - z) * scale, exact in float32
for the float16 / bfloat16 scales checkpoints carry, but not always in float16.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from tritium.kernels.quant_layouts import pack_int4

from ..convert import CheckpointError
from ..quant.quantize_int4 import SUPPORTED_GROUP_SIZES


@dataclass
class ImportedLinear:
    method: str                              # "int4" | "int8" | "fp8" | "none"
    tensors: Dict[str, torch.Tensor]         # int4: codes, scales, zeros[, g_idx]; int8/fp8: qweight, scales; none: weight
    group_size: Optional[int] = None         # int4; int8 with group-wise scales (None: per row)


def int4_from_codes(codes: torch.Tensor, scales: torch.Tensor, zero_points: Optional[torch.Tensor],
                    group_size: Optional[int], g_idx: Optional[torch.Tensor], name: str) -> ImportedLinear:
    """Tritium int4 from unsigned codes (N, K) 0..15 with w = (q - z) * s, s and z (N_groups, N).

    zero_points None means symmetric around 8 (z = 8, zero = 0). group_size None = one group per
    output channel (re-expressed exactly as groups of the largest supported size dividing K)."""
    n, k = codes.shape
    s = scales.float()
    z = torch.full_like(s, 8.0) if zero_points is None else zero_points.float()
    if group_size is None:
        group_size = next((gs for gs in sorted(SUPPORTED_GROUP_SIZES, reverse=True) if k % gs == 0), None)
        if group_size is None:
            raise CheckpointError(f"{name}: per-channel int4 with in_features {k} is not supported: Tritium's int4 "
                                  f"kernels need groups of {', '.join(map(str, SUPPORTED_GROUP_SIZES))} dividing it")
        if s.shape[0] != 1:
            raise CheckpointError(f"{name}: per-channel scales have shape {tuple(scales.shape)}, expected (1, {n})")
        s, z = s.expand(k // group_size, n), z.expand(k // group_size, n)
    elif group_size not in SUPPORTED_GROUP_SIZES and g_idx is None:
        # e.g. 512: groups of 256 repeating each scale, exactly the same weights
        sub = next((gs for gs in sorted(SUPPORTED_GROUP_SIZES, reverse=True) if group_size % gs == 0), None)
        if sub is None:
            raise CheckpointError(f"{name}: group size {group_size} is not supported; supported: multiples of 32")
        s, z = s.repeat_interleave(group_size // sub, 0), z.repeat_interleave(group_size // sub, 0)
        group_size = sub
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise CheckpointError(f"{name}: group size {group_size} with act-order (g_idx) is not supported; "
                              f"supported: {', '.join(map(str, SUPPORTED_GROUP_SIZES))}")
    if k % group_size:
        raise CheckpointError(f"{name}: group size {group_size} does not divide in_features {k}")
    if s.shape != (k // group_size, n):
        raise CheckpointError(f"{name}: scales have shape {tuple(s.shape)}, expected {(k // group_size, n)}")
    if g_idx is not None:
        g_idx = g_idx.to(torch.int32)
        if torch.equal(g_idx.long(), torch.arange(k) // group_size):
            g_idx = None  # no act-order: the plain layout
        elif g_idx.shape != (k,) or g_idx.min() < 0 or g_idx.max() >= k // group_size or \
                torch.bincount(g_idx.long(), minlength=k // group_size).ne(group_size).any():
            raise CheckpointError(f"{name}: g_idx must assign exactly {group_size} input channels to each group")
    t = {"codes": codes.to(torch.uint8), "scales": s.contiguous(), "zeros": ((8.0 - z) * s).contiguous()}
    if g_idx is not None:
        t["g_idx"] = g_idx
    return ImportedLinear("int4", t, group_size)


def fuse(parts: List[ImportedLinear], name: str) -> ImportedLinear:
    """Concatenate linears that share their input (q, k, v or gate, up) along the output dim."""
    methods = {p.method for p in parts}
    if len(methods) != 1:
        raise CheckpointError(f"{name}: its parts are stored differently ({sorted(methods)}); Tritium fuses them "
                              f"into one linear, so they must share one quantization scheme")
    method = methods.pop()
    if method == "int4":
        sizes = {p.group_size for p in parts}
        if len(sizes) != 1:
            raise CheckpointError(f"{name}: its parts use different group sizes {sorted(sizes)}")
        gi = [p.tensors.get("g_idx") for p in parts]
        if any(g is None for g in gi) != all(g is None for g in gi) or (
                gi[0] is not None and not all(torch.equal(gi[0], g) for g in gi[1:])):
            raise CheckpointError(f"{name}: its parts carry different act-order g_idx; Tritium fuses them into "
                                  f"one linear with one g_idx")
        t = {"codes": torch.cat([p.tensors["codes"] for p in parts], 0),
             "scales": torch.cat([p.tensors["scales"] for p in parts], 1),
             "zeros": torch.cat([p.tensors["zeros"] for p in parts], 1)}
        if gi[0] is not None:
            t["g_idx"] = gi[0]
        return ImportedLinear("int4", t, parts[0].group_size)
    sizes = {p.group_size for p in parts}
    if len(sizes) != 1:
        raise CheckpointError(f"{name}: its parts use different group sizes {sorted(sizes, key=str)}")
    group_size = sizes.pop()
    keys = parts[0].tensors.keys()
    # per-row scales (N,) stack along the output dim like the codes; grouped scales (K/G, N) side by side
    return ImportedLinear(method, {k: torch.cat([p.tensors[k] for p in parts],
                                                1 if (group_size is not None and k == "scales") else 0)
                                   for k in keys}, group_size)


def engine_tensors(lin: ImportedLinear, dtype: torch.dtype) -> Dict[str, torch.Tensor]:
    """The engine tensors (suffix -> tensor) of one linear."""
    if lin.method == "none":
        return {"weight": lin.tensors["weight"].to(dtype)}
    if lin.method == "int4":
        out = {"qweight": pack_int4(lin.tensors["codes"]), "scales": lin.tensors["scales"],
               "zeros": lin.tensors["zeros"]}
        if "g_idx" in lin.tensors:
            out["g_idx"] = lin.tensors["g_idx"]
        return out
    return dict(lin.tensors)
