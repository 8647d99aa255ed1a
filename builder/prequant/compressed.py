"""compressed-tensors (llm-compressor) linears -> ImportedLinear.

Tensor names and meanings, from compressed-tensors' compressors (0.20):
- pack-quantized: weight_packed int32 (N, ceil(K * bits / 32)), 32 // bits codes per word, code i
  at bits [i * bits, (i + 1) * bits), stored as the signed code plus 2^(bits-1);
  weight_scale (N, K/G) (group) or (N, 1) (channel); weight_zero_point (asym only) signed codes
  packed the same way along the output dim: int32 (ceil(N / 8), K/G); weight_shape int (2,);
  optional weight_g_idx int (K,) (the removed "group" act-order of older versions).
  w = (q - zero_point) * scale.
- pack-quantized 8-bit (compressed-tensors' W8A16): four codes per int32 word, each the signed
  code plus 128; weight_scale (N, 1) (channel) or (N, K/G) (group): w = q * scale.
- int-quantized / naive-quantized (one compressor): weight int8 (N, K), codes unpacked (4-bit
  ones in -8..7), weight_scale, weight_zero_point int8 as computed: w = (q - zero_point) * scale.
- float-quantized: weight float8_e4m3fn (N, K), weight_scale (1,) / (N, 1): w = float(q) * scale.
  An FP8 W8A8 checkpoint also carries input_scale (static activations) or quantizes activations
  dynamically; Tritium runs the weights only (input_scale is not read).
"""
from __future__ import annotations

from typing import Callable

import torch

from ..convert import CheckpointError
from .linear import ImportedLinear, int4_from_codes
from .spec import WeightScheme


def _unpack_nibbles(packed: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """int32 (rows, ceil(cols / 8)) -> uint8 (rows, cols): nibble i of word j is column 8 j + i."""
    words = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    codes = ((words[:, :, None] >> shifts) & 0xF).reshape(words.shape[0], -1)
    return codes[:rows, :cols].to(torch.uint8)


def _unpack_bytes(packed: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """8-bit pack-quantized: int32 (rows, ceil(cols / 4)), byte i of word j is column 4 j + i,
    stored as the signed code + 128 -> int8 (rows, cols)."""
    words = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, 8, dtype=torch.int64)
    codes = ((words[:, :, None] >> shifts) & 0xFF).reshape(words.shape[0], -1)[:rows, :cols]
    return (codes - 128).to(torch.int8)


def read_linear(get: Callable, has: Callable, prefix: str, scheme: WeightScheme) -> ImportedLinear:
    """The linear HF module `prefix` (e.g. model.layers.0.mlp.down_proj) stored per `scheme`."""
    if scheme.kind == "int4":
        return _int4(get, has, prefix, scheme)
    if scheme.kind == "int8":
        if scheme.ct_format == "pack-quantized":
            shape = [int(v) for v in get(prefix + ".weight_shape").reshape(-1).tolist()]
            q = _unpack_bytes(get(prefix + ".weight_packed"), *shape)
        else:
            q = get(prefix + ".weight")
            if q.dtype != torch.int8:
                raise CheckpointError(f"{prefix}.weight: dtype {q.dtype}, expected torch.int8 (int-quantized)")
        scale = get(prefix + ".weight_scale")
        if scheme.strategy == "group":
            return ImportedLinear("int8", {"qweight": q, "scales": _group_scales(scale, q, scheme.group_size, prefix)},
                                  scheme.group_size)
        return ImportedLinear("int8", {"qweight": q, "scales": _row_scales(scale, q, prefix)})
    q = get(prefix + ".weight")
    if q.dtype != torch.float8_e4m3fn:
        raise CheckpointError(f"{prefix}.weight: dtype {q.dtype} is not supported; supported: float8_e4m3fn")
    return ImportedLinear("fp8", {"qweight": q, "scales": _row_scales(get(prefix + ".weight_scale"), q, prefix)})


def _group_scales(scale: torch.Tensor, q: torch.Tensor, group_size: int, prefix: str) -> torch.Tensor:
    """(K/G, N) float32 scales (Tritium's grouped int8 layout) from weight_scale (N, K/G):
    w = q * scale[n, k // G], symmetric."""
    n, k = q.shape
    if k % group_size:
        raise CheckpointError(f"{prefix}: group_size {group_size} does not divide in_features {k}")
    if tuple(scale.shape) != (n, k // group_size):
        raise CheckpointError(f"{prefix}.weight_scale: shape {tuple(scale.shape)}, expected ({n}, {k // group_size})")
    return scale.float().t().contiguous()


def _row_scales(scale: torch.Tensor, q: torch.Tensor, prefix: str) -> torch.Tensor:
    """(N,) float32 scales from a per-tensor (1,) / () or per-channel (N, 1) / (N,) weight_scale."""
    n = q.shape[0]
    s = scale.float().reshape(-1)
    if s.numel() == 1:
        return s.expand(n).contiguous()
    if s.numel() != n:
        raise CheckpointError(f"{prefix}.weight_scale: shape {tuple(scale.shape)}, expected (1,) or ({n}, 1)")
    return s.contiguous()


def _int4(get, has, prefix: str, scheme: WeightScheme) -> ImportedLinear:
    scale = get(prefix + ".weight_scale")            # (N, K/G) or (N, 1)
    if scheme.ct_format != "pack-quantized":         # unpacked: int8 codes in -8..7, zero points as stored
        q = get(prefix + ".weight")
        if q.dtype != torch.int8:
            raise CheckpointError(f"{prefix}.weight: dtype {q.dtype}, expected torch.int8 ({scheme.ct_format})")
        z = None if scheme.symmetric else (get(prefix + ".weight_zero_point").to(torch.int16) + 8).t()
        g_idx = get(prefix + ".weight_g_idx") if has(prefix + ".weight_g_idx") else None
        return int4_from_codes((q.to(torch.int16) + 8).to(torch.uint8), scale.t(), z,
                               scheme.group_size if scheme.strategy == "group" else None, g_idx, prefix)
    shape = [int(v) for v in get(prefix + ".weight_shape").reshape(-1).tolist()]
    if len(shape) != 2:
        raise CheckpointError(f"{prefix}.weight_shape: {shape}, expected [out_features, in_features]")
    n, k = shape
    codes = _unpack_nibbles(get(prefix + ".weight_packed"), n, k)
    z = None
    if not scheme.symmetric:
        # signed zero points, packed (offset by 8 like the codes) along the output dim:
        # int32 (ceil(N/8), K/G); unpacking the transpose gives the unsigned zero points (K/G, N)
        zpp = get(prefix + ".weight_zero_point")
        z = _unpack_nibbles(zpp.t().contiguous(), scale.shape[1], n)
    g_idx = get(prefix + ".weight_g_idx") if has(prefix + ".weight_g_idx") else None
    # code u = signed q + 8, so w = (q - zp) * s = (u - z) * s with z = zp + 8 (8 when symmetric)
    return int4_from_codes(codes, scale.t(), z, scheme.group_size if scheme.strategy == "group" else None,
                           g_idx, prefix)
