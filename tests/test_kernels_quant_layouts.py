"""The Triton GEMMs read exactly what the builder's quantizers write.

Oracle: the builder's own dequantize_* functions (a separate implementation of each layout)
followed by a float matmul, and the unquantized float weight within the quantization error.
"""
from __future__ import annotations

import kernel_env  # noqa: F401  (must precede the kernel imports: sets TRITON_INTERPRET=1)
import pytest
import torch
from kernel_env import assert_close, new_rng

from tritium.builder.quant.quantize_fp8 import dequantize_fp8, quantize_fp8
from tritium.builder.quant.quantize_int4 import quantize_int4
from tritium.kernels.quant_layouts import dequantize_int4, pack_int4
from tritium.builder.quant.quantize_int8 import dequantize_int8, quantize_int8
from tritium.kernels.gemm_triton import fp8_gemm, w4a16_gemm, w8a16_gemm


def _shapes(rng):
    return rng.choice([1, 5, 17]), rng.choice([48, 96, 130]), 64 * rng.randint(1, 4)


@pytest.mark.parametrize("case", range(4))
def test_w4a16_kernel_reads_builder_int4(case):
    rng, seed = new_rng()
    m, n, k = _shapes(rng)
    group = (32, 64)[case % 2]
    w, x = torch.randn(n, k) * 0.05, torch.randn(m, k)
    qweight, scales, zeros = quantize_int4(w, group)
    got = w4a16_gemm(x, qweight, scales, zeros, group)
    assert_close(got, x @ dequantize_int4(qweight, scales, zeros, group).t(), torch.float32, f"seed={seed}")
    # and it approximates the float layer: RTN on 16 levels leaves ~10% relative weight error
    want = x @ w.t()
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 0.2, f"seed={seed} relative error {rel}"


@pytest.mark.parametrize("group", [32, 64])
def test_w4a16_kernel_reads_symmetric_int4(group):
    """The symmetric layout (no zeros tensor, zeros=None) of quantize_int4(symmetric=True)."""
    rng, seed = new_rng()
    m, n, k = _shapes(rng)
    w, x = torch.randn(n, k) * 0.05, torch.randn(m, k)
    qweight, scales, zeros = quantize_int4(w, group, symmetric=True)
    assert not bool(zeros.any())
    s16 = scales.half()
    got = w4a16_gemm(x, qweight, s16, None, group)
    assert_close(got, x @ dequantize_int4(qweight, s16, None, group).t(), torch.float32, f"seed={seed}")
    want = x @ w.t()
    assert ((got - want).norm() / want.norm()).item() < 0.25, f"seed={seed}"


def test_w4a16_kernel_reads_builder_int4_act_order():
    rng, seed = new_rng()
    m, n, k = _shapes(rng)
    group = 32
    perm = torch.randperm(k)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = (torch.arange(k) // group).int()  # GPTQ desc_act: groups over permuted channels
    qweight = pack_int4(torch.randint(0, 16, (n, k)))
    scales, zeros = torch.rand(k // group, n) * 0.01, torch.randn(k // group, n) * 0.01
    x = torch.randn(m, k)
    want = x @ dequantize_int4(qweight, scales, zeros, group, g_idx).t()
    assert_close(w4a16_gemm(x, qweight, scales, zeros, group, g_idx), want, torch.float32, f"seed={seed}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a16_kernel_reads_builder_int8_and_fp8(dtype):
    rng, seed = new_rng()
    m, n, k = _shapes(rng)
    w, x = torch.randn(n, k) * 0.05, torch.randn(m, k).to(dtype)
    q8, s8 = quantize_int8(w)
    assert_close(w8a16_gemm(x, q8, s8), x.float() @ dequantize_int8(q8, s8).t(), dtype, f"seed={seed}")
    qf, sf = quantize_fp8(w)
    assert_close(w8a16_gemm(x, qf, sf), x.float() @ dequantize_fp8(qf, sf).t(), dtype, f"seed={seed}")


def test_fp8_w8a8_kernel_reads_builder_fp8():
    rng, seed = new_rng()
    m, n, k = _shapes(rng)
    w, x = torch.randn(n, k) * 0.05, torch.randn(m, k)
    qf, sf = quantize_fp8(w)
    got = fp8_gemm(x, qf, sf)
    want = x @ w.t()
    # two E4M3 roundings (weight and activation, <= 2^-4 relative each, ~3.6% rms)
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 0.1, f"seed={seed} relative error {rel}"
