"""The packed weight layouts of quantized engines: the contract between the builder that writes
them and the kernels and runtime that read them.

    int4: qweight uint8   (N, K // 2)  two 4-bit codes per byte: low nibble = even k, high = odd k
          scales  float16 (K // G, N)
          zeros   float16 (K // G, N)  absent in the symmetric layout (LayerQuant.symmetric, the
                                       default of Tritium's builds: llama.cpp Q4_0's grid, codes
                                       -8..7 times a float16 scale, 4.5 bits per weight at G = 32);
                                       (scales and zeros float32 in engines imported from
                                        pre-quantized checkpoints: zero = (8 - z) * scale is exact
                                        in float32 for their float16 / bfloat16 scales, not in float16)
          g_idx   int32   (K,)         optional (GPTQ act-order): the group of input channel k
          w[n, k] = (q[n, k] - 8) * scales[g, n] + zeros[g, n],   g = k // G  (or g_idx[k]);
          zeros[g, n] = 0 when absent
          An asymmetric (scale, min) quantizer stores zero = min + 8 * scale, which is exactly the
          (scale, zero) convention of `aten._weight_int4pack_mm_for_cpu`.
    int8: qweight int8 (N, K), scales bfloat16 (N,) (float32 in imported engines and before
          engine format 3; the values are bfloat16 values either way for Tritium's own builds):
          w[n, k] = q[n, k] * scales[n]
    int6 (the embedding / LM head only, `--embedding-quantization int6`):
          qweight uint8 (N, 3 K // 4): four 6-bit codes u = q + 32 (q in -32..31) in three bytes,
          little-endian: bytes b0 b1 b2 of u0 | u1 << 6 | u2 << 12 | u3 << 18 (k = 4 j .. 4 j + 3);
          scales bfloat16 (N,): w[n, k] = q[n, k] * scales[n]  (6 + 16 / K bits per weight);
          grouped (LayerQuant.group_size = G): scales float16 (K // G, N),
          w[n, k] = q[n, k] * scales[k // G, n]  (6 + 16 / G bits per weight)
    fp8:  qweight float8_e4m3fn (N, K), scales float32 (N,):  w[n, k] = float(q[n, k]) * scales[n]
    int8 / fp8 grouped (LayerQuant.group_size = G set): the same qweight, with
          scales  float16 (K // G, N)
          zeros   float16 (K // G, N)  only when LayerQuant.asymmetric (else zero = 0)
          w[n, k] = float(q[n, k]) * scales[g, n] + zeros[g, n],   g = k // G
          float16 holds every GGUF block's float16 d and m, so a source grid (a Q4_1 block's
          d * q + m) is stored exactly; bfloat16 for a tensor past float16's range; float32 in
          imported engines and before engine format 3.
    Readers take float32, float16 or bfloat16 for every scales / zeros tensor and compute in
    float32 (engine format 3 stores 16 bits; older engines load unchanged).

This module holds only the layouts and their exact inverses (no quantizer), so the runtime and
the kernels can read engines without importing the builder.
"""
from __future__ import annotations

from typing import Optional

import torch

# `tritium build --int4-layout`: the int4 linears' grid (LayerQuant.symmetric: no zeros); the first is
# the default (symmetric groups missed the 3% held-out budget on SmolLM2's Q4_1 GGUF, docs/quantization.md).
INT4_LAYOUTS = ("asymmetric", "symmetric")
INT4_LAYOUT = ("qweight uint8 (N, K//2): low nibble = even k, high nibble = odd k, codes 0..15; "
               "scales float16 (K//G, N); zeros float16 (K//G, N) (float32 when imported; absent in "
               "symmetric layers, then 0); "
               "optional g_idx int32 (K,); "
               "w[n,k] = (q[n,k] - 8) * scales[g,n] + zeros[g,n], g = k // G or g_idx[k]")
INT8_LAYOUT = ("qweight int8 (N, K); scales bfloat16 (N,) (float32 when imported); w[n,k] = qweight[n,k] * scales[n] "
               "(symmetric per output channel; scales are bfloat16 values). An LM head marked centred: logits = (h - head_input_mean) w^T "
               "+ head_mean_logits, both float32, (K,) and (N,)")
INT8_GROUPED_LAYOUT = ("qweight int8 (N, K); scales float16 (K//G, N); zeros float16 (K//G, N) when asymmetric "
                       "(bfloat16 past float16's range, float32 when imported); "
                       "w[n,k] = qweight[n,k] * scales[g,n] + zeros[g,n], g = k // G (zeros absent: 0)")
FP8_GROUPED_LAYOUT = ("qweight float8_e4m3fn (N, K); scales float16 (K//G, N); zeros float16 (K//G, N) when "
                      "asymmetric (bfloat16 past float16's range); w[n,k] = float(qweight[n,k]) * scales[g,n] + zeros[g,n], g = k // G")
INT6_LAYOUT = ("qweight uint8 (N, 3K/4): codes u = q + 32 (q in -32..31), four in three bytes, "
               "little-endian u0 | u1 << 6 | u2 << 12 | u3 << 18; scales bfloat16 (N,): w[n,k] = q[n,k] * scales[n]; "
               "grouped: scales float16 (K//G, N): w[n,k] = q[n,k] * scales[k // G, n]")
FP8_LAYOUT = ("qweight float8_e4m3fn (N, K); scales float32 (N,); "
              "w[n,k] = float(qweight[n,k]) * scales[n] (per output channel, amax -> 448)")


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q: integer (N, K) codes in 0..15 -> uint8 (N, K//2), even k in the low nibble."""
    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """uint8 (N, K//2) -> uint8 codes (N, K)."""
    lo = qweight & 0x0F
    hi = qweight >> 4
    return torch.stack((lo, hi), dim=-1).reshape(qweight.shape[0], -1)


def pack_int6(q: torch.Tensor) -> torch.Tensor:
    """q: integer (N, K) codes in -32..31, K a multiple of 4 -> uint8 (N, 3 K // 4) (INT6_LAYOUT)."""
    n, k = q.shape
    if k % 4:
        raise ValueError(f"int6 layout: K = {k} is not a multiple of 4")
    if q.numel() and (int(q.min()) < -32 or int(q.max()) > 31):
        raise ValueError("int6 layout: codes must lie in -32..31")
    u = (q.to(torch.int32) + 32).view(n, k // 4, 4)
    v = u[..., 0] | (u[..., 1] << 6) | (u[..., 2] << 12) | (u[..., 3] << 18)
    return torch.stack((v & 0xFF, (v >> 8) & 0xFF, (v >> 16) & 0xFF), -1).to(torch.uint8).reshape(n, -1)


def unpack_int6(qweight: torch.Tensor) -> torch.Tensor:
    """uint8 (N, 3 K // 4) -> int8 codes (N, K) in -32..31 (inverse of pack_int6)."""
    n, m = qweight.shape
    if m % 3:
        raise ValueError(f"int6 layout: {m} bytes per row is not a multiple of 3")
    b = qweight.to(torch.int32).view(n, m // 3, 3)
    v = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
    u = torch.stack((v & 63, (v >> 6) & 63, (v >> 12) & 63, (v >> 18) & 63), -1)
    return (u - 32).to(torch.int8).reshape(n, -1)


def dequantize_int6(qweight: torch.Tensor, scales: torch.Tensor, group_size: Optional[int] = None,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Float weight (N, K) of the int6 layout: q * scales[n], or q * scales[k // G, n] with
    group_size G (computed in float32)."""
    if group_size:
        return dequantize_grouped(unpack_int6(qweight), scales, None, group_size, dtype)
    return dequantize_rowwise(unpack_int6(qweight), scales, dtype)


def group_index(k: int, group_size: int, g_idx: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Group of each input channel: g_idx if given, else k // group_size."""
    if g_idx is not None:
        return g_idx.long()
    return torch.arange(k) // group_size


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                    group_size: int, g_idx: Optional[torch.Tensor] = None,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Float weight (N, K) of the int4 layout (computed in float32, returned in `dtype`);
    zeros None: the symmetric layout, w = (q - 8) * scale."""
    q = unpack_int4(qweight).float()
    g = group_index(q.shape[1], group_size, g_idx).to(qweight.device)
    w = (q - 8.0) * scales.float()[g].t()
    if zeros is not None:
        w = w + zeros.float()[g].t()
    return w.to(dtype)


def dequantize_rowwise(qweight: torch.Tensor, scales: torch.Tensor,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Float weight (N, K) of the int8 or fp8 layout: q * scales[n]."""
    return (qweight.float() * scales.float()[:, None]).to(dtype)


def dequantize_grouped(qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                       group_size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Float weight (N, K) of the grouped int8 / fp8 layout: q * scales[g, n] (+ zeros[g, n]),
    g = k // group_size (computed in float32, returned in `dtype`)."""
    n, k = qweight.shape
    if group_size <= 0 or k % group_size or scales.shape != (k // group_size, n):
        raise ValueError(f"grouped layout: scales {tuple(scales.shape)} do not fit qweight {(n, k)} "
                         f"with group_size {group_size}")
    q = qweight.float().view(n, k // group_size, group_size)
    w = q * scales.float().t()[:, :, None]
    if zeros is not None:
        w = w + zeros.float().t()[:, :, None]
    return w.reshape(n, k).to(dtype)
