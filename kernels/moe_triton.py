"""Fused MoE in Triton: tokens sorted and padded per expert, one grouped-GEMM launch per projection.

The (token, slot) pairs are sorted by expert and each expert's run padded to BLOCK_M rows
(moe_ref.moe_align), so that every row tile of the launch multiplies by one expert's matrix:
    launch 1  C1[p] = x[p // k] @ w_gate_up[e]^T              (T*k, 2I)
    act       H[p]  = act(C1[p])                               (T*k, I)   (ops' activation)
    launch 2  C2[p] = topk_weights[p] * H[p] @ w_down[e]^T      (T*k, H)
    sum       out[t] = sum_j C2[t * k + j]
gpt-oss: per-expert biases in each launch's epilogue (before the routing weight), and MXFP4
experts decoded in the tile as they are loaded (kernels/mxfp4.py: E2M1 code times 2^(E8M0 - 127)).
Tiles of the unused tail (block_expert == -1) return at once; padding rows carry the sentinel id
T*k and neither load nor store. The layout follows vLLM's fused_moe (sorted ids, per-block
expert ids); the code is this project's own.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .moe_ref import ActMul, QuantExperts, moe_align
from .silu_mul_ref import silu_mul_ref
from .triton_common import TORCH_FLOATS, check_dtype, dot_upcast, mm

BLOCK_M = 16


@triton.jit
def _e2m1(code):
    """FP4 E2M1 code (int32 0..15) -> float32: sign, 2 exponent bits (bias 1), 1 mantissa bit."""
    ex = ((code >> 1) & 3).to(tl.float32)
    man = (code & 1).to(tl.float32)
    mag = tl.where(ex == 0.0, man * 0.5, tl.exp2(ex - 1.0) * (1.0 + man * 0.5))
    return tl.where((code >> 3) != 0, -mag, mag)


@triton.jit
def _moe_gemm_kernel(a_ptr, b_ptr, c_ptr, w_ptr, s_ptr, bias_ptr, sorted_ids_ptr, block_expert_ptr, num_pairs, N, K,
                     stride_am, stride_be, stride_bn, stride_cm, stride_se, stride_sn, stride_bias_e,
                     A_ROW_DIV: tl.constexpr, MUL_WEIGHT: tl.constexpr, UPCAST: tl.constexpr, INT8: tl.constexpr,
                     MXFP4: tl.constexpr, HAS_BIAS: tl.constexpr,
                     IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m)
    if e < 0:
        return
    ids = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = ids < num_pairs
    a_rows = ids // A_ROW_DIV
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + offs_k[None, :],
                    mask=valid[:, None] & (offs_k[None, :] < K), other=0.0)
        bmask = (offs_n[None, :] < N) & (offs_k[:, None] < K)
        if MXFP4:
            # b[k, n] = e2m1(code) * 2^(scale byte - 127); code = nibble k % 2 of byte k // 2
            byte = tl.load(b_ptr + e.to(tl.int64) * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] // 2,
                           mask=bmask, other=0).to(tl.int32)
            code = (byte >> ((offs_k[:, None] % 2) * 4)) & 15
            sc = tl.load(s_ptr + e.to(tl.int64) * stride_se + offs_n[None, :] * stride_sn + offs_k[:, None] // 32,
                         mask=bmask, other=127).to(tl.float32)
            b = _e2m1(code) * tl.exp2(sc - 127.0)
            if not UPCAST:
                b = b.to(a.dtype)
        else:
            b = tl.load(b_ptr + e.to(tl.int64) * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None],
                        mask=bmask, other=0.0)
        if INT8:  # W8A16 (int8 or E4M3 codes): codes to the activation dtype, the per-channel scale in the epilogue
            if UPCAST:
                b = b.to(tl.float32)
            else:
                b = b.to(a.dtype)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc += mm(a, b, IEEE)
    if INT8:
        sc = tl.load(s_ptr + e.to(tl.int64) * stride_se + offs_n, mask=offs_n < N, other=0.0)
        acc = acc * sc[None, :]
    if HAS_BIAS:  # gpt-oss: the expert's bias, before the routing weight
        bias = tl.load(bias_ptr + e.to(tl.int64) * stride_bias_e + offs_n, mask=offs_n < N, other=0.0)
        acc = acc + bias[None, :].to(tl.float32)
    if MUL_WEIGHT:
        w = tl.load(w_ptr + ids, mask=valid, other=0.0)
        acc = acc * w[:, None].to(tl.float32)
    tl.store(c_ptr + ids[:, None] * stride_cm + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=valid[:, None] & (offs_n[None, :] < N))


def _grouped_gemm(a, w, out, weights, sorted_ids, block_expert, num_pairs, a_row_div, mul_weight, bias=None):
    """w: float (E, N, K) or QuantExperts int8 / fp8 (codes (E, N, K), scales (E, N)) or mxfp4 (codes
    (E, N, K // 2), exponents (E, N, K // 32)); bias: None or (E, N)."""
    scales, mxfp4 = None, False
    if isinstance(w, QuantExperts):
        mxfp4 = w.method == "mxfp4"
        n, k = w.shape[1], w.shape[2]
        w, scales = w.qweight, (w.scales.contiguous() if mxfp4 else w.scales.float().contiguous())
    else:
        n, k = w.shape[1], w.shape[2]
    if bias is not None:
        bias = bias.contiguous()
    block_n = max(16, min(64, triton.next_power_of_2(n)))
    block_k = max(32 if mxfp4 else 16, min(64, triton.next_power_of_2(k)))
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    _moe_gemm_kernel[grid](a, w, out, weights, weights if scales is None else scales,
                           weights if bias is None else bias, sorted_ids, block_expert,
                           num_pairs, n, k, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
                           0 if scales is None else scales.stride(0), scales.stride(1) if mxfp4 else 0,
                           0 if bias is None else bias.stride(0),
                           A_ROW_DIV=a_row_div, MUL_WEIGHT=mul_weight, UPCAST=dot_upcast(a.dtype),
                           INT8=scales is not None and not mxfp4, MXFP4=mxfp4, HAS_BIAS=bias is not None,
                           IEEE=a.dtype == torch.float32, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k)


def fused_moe(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, act_mul: ActMul = silu_mul_ref, b_gate_up: Optional[torch.Tensor] = None,
              b_down: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Same contract as moe_ref.fused_moe_ref; the experts float (E, N, K) or int8 / fp8 (E4M3,
    per-channel scales) / mxfp4 QuantExperts (int4 experts take the torch path in ops.fused_moe); biases (E, N) or None."""
    check_dtype("x", x, TORCH_FLOATS)
    for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        if isinstance(w, QuantExperts):
            if w.method not in ("int8", "fp8", "mxfp4"):
                raise ValueError(f"{name}: {w.method} experts are not supported by the Triton MoE kernel; "
                                 f"allowed: int8, fp8, mxfp4")
        else:
            check_dtype(name, w, TORCH_FLOATS)
    x = x.contiguous()
    w_gate_up = w_gate_up if isinstance(w_gate_up, QuantExperts) else w_gate_up.contiguous()
    w_down = w_down if isinstance(w_down, QuantExperts) else w_down.contiguous()
    t, k = topk_ids.shape
    num_experts, two_i, h = w_gate_up.shape
    for name, b, n in (("b_gate_up", b_gate_up, two_i), ("b_down", b_down, w_down.shape[1])):
        if b is not None and tuple(b.shape) != (num_experts, n):
            raise ValueError(f"{name}: expected shape {(num_experts, n)}, got {tuple(b.shape)}")
    sorted_ids, block_expert = moe_align(topk_ids, num_experts, BLOCK_M)
    weights = topk_weights.reshape(-1).float().contiguous()
    c1 = torch.empty(t * k, two_i, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w_gate_up, c1, weights, sorted_ids, block_expert, t * k, k, False, b_gate_up)
    hid = act_mul(c1).contiguous()
    h = w_down.shape[1]
    c2 = torch.empty(t * k, h, dtype=torch.float32, device=x.device)
    _grouped_gemm(hid, w_down, c2, weights, sorted_ids, block_expert, t * k, 1, True, b_down)
    return c2.view(t, k, h).sum(1).to(x.dtype)
