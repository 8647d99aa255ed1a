"""Triton quantized GEMMs (W4A16 incl. GPTQ g_idx, W8A16 int8/fp8, FP8 W8A8) and the per-token
FP8 quantizer vs the torch references in gemm_ref.py, under the interpreter on CPU.
"""
from __future__ import annotations

import kernel_env  # noqa: F401  (must precede the kernel imports: sets TRITON_INTERPRET=1)
import pytest
import torch
from kernel_env import FP8_STEP, NUM_CASES, assert_close, new_rng

from tritium.kernels import gemm_ref
from tritium.kernels.gemm_triton import fp8_gemm, quantize_fp8_per_token, w4a16_gemm, w8a16_gemm

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _mnk(rng, k_multiple=16):
    m = rng.choice([1, 3, 16, 33])
    n = rng.choice([24, 64, 100, 136])
    k = k_multiple * rng.randint(1, max(1, 384 // k_multiple))
    return m, n, k


def _x_bias_out(m, n, k, dtype, case):
    x = torch.randn(m, k).to(dtype)
    bias = torch.randn(n).to(dtype) if case % 3 == 1 else None
    out = torch.full((m, n), float("nan"), dtype=dtype)
    return x, bias, out


@pytest.mark.parametrize("case", range(NUM_CASES))
def test_w4a16_gemm_kernel(case):
    rng, seed = new_rng()
    dtype = DTYPES[case % 3]
    group = (32, 64, 128, 48)[case % 4]  # 48: a group that does not tile the K blocks evenly
    m, n, _ = _mnk(rng)
    k = group * rng.randint(1, 3)
    qweight = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    pdt = PARAM_DTYPES[(case // 2) % 3]  # engines store float16 (format 3), older / imported float32
    scales = (torch.rand(k // group, n) * 0.02 + 1e-3).to(pdt)
    zeros = (torch.randn(k // group, n) * 0.01).to(pdt)
    g_idx = None
    if case % 5 == 2:  # GPTQ act-order: groups follow a permutation of the input channels
        perm = torch.randperm(k)
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[perm] = (torch.arange(k) // group).int()
    x, bias, out = _x_bias_out(m, n, k, dtype, case)
    got = w4a16_gemm(x, qweight, scales, zeros, group, g_idx, bias, out=out)
    ref = gemm_ref.w4a16_gemm_ref(x, qweight, scales, zeros, group, g_idx, bias)
    assert_close(got, ref, dtype, f"seed={seed} m={m} n={n} k={k} G={group} g_idx={g_idx is not None} params={pdt}")


@pytest.mark.parametrize("case", range(NUM_CASES))
def test_w8a16_gemm_kernel(case):
    rng, seed = new_rng()
    dtype = DTYPES[case % 3]
    m, n, k = _mnk(rng)
    if case % 2:
        qweight = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    else:  # FP8 weight-only (the CPU-style fp8 path), same kernel
        qweight = (torch.randn(n, k) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    pdt = PARAM_DTYPES[(case // 2) % 3]  # per-row int8 scales are stored bfloat16 (format 3)
    scales = (torch.rand(n) * 0.01 + 1e-4).to(pdt)
    x, bias, out = _x_bias_out(m, n, k, dtype, case)
    got = w8a16_gemm(x, qweight, scales, bias, out=out)
    ref = gemm_ref.w8a16_gemm_ref(x, qweight, scales, bias)
    assert_close(got, ref, dtype, f"seed={seed} m={m} n={n} k={k} w={qweight.dtype} params={pdt}")


@pytest.mark.parametrize("case", range(NUM_CASES))
def test_w8a16_grouped_gemm_kernel(case):
    """The grouped int8 / fp8 layout (scales (K/G, N), optional zeros) against its torch reference,
    with K tiles inside one group (G a power of two) and groups cutting tiles (G = 48)."""
    rng, seed = new_rng()
    dtype = DTYPES[case % 3]
    m, n, _ = _mnk(rng)
    group = (32, 64, 128, 48)[case % 4]
    k = group * rng.randint(1, 4)
    if case % 2:
        qweight = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    else:
        qweight = (torch.randn(n, k) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    pdt = PARAM_DTYPES[(case // 2) % 3]  # engines store float16 (format 3), older / imported float32
    scales = (torch.rand(k // group, n) * 0.01 + 1e-4).to(pdt)
    zeros = (torch.randn(k // group, n) * 0.05).to(pdt) if case % 3 else None
    x, bias, out = _x_bias_out(m, n, k, dtype, case)
    got = w8a16_gemm(x, qweight, scales, bias, out=out, zeros=zeros, group_size=group)
    ref = gemm_ref.w8a16_gemm_ref(x, qweight, scales, bias, zeros, group)
    assert_close(got, ref, dtype, f"seed={seed} m={m} n={n} k={k} G={group} zeros={zeros is not None} params={pdt}")


@pytest.mark.parametrize("case", range(NUM_CASES))
def test_fp8_quant_per_token_kernel(case):
    rng, seed = new_rng()
    dtype = DTYPES[case % 3]
    m, _, k = _mnk(rng)
    x = (torch.randn(m, k) * 10 ** rng.uniform(-3, 2)).to(dtype)
    if case % 4 == 0:
        x[0] = 0  # an all-zero token must give zeros, not NaN
    xq, xs = quantize_fp8_per_token(x)
    rq, rs = gemm_ref.quantize_fp8_per_token_ref(x)
    msg = f"seed={seed} m={m} k={k} {dtype}"
    torch.testing.assert_close(xs, rs, rtol=1e-6, atol=0, msg=msg)
    g, r = xq.float(), rq.float()
    assert not g.isnan().any(), msg
    # FP8: equal up to one E4M3 rounding step where the division rounds differently (GPU)
    assert ((g - r).abs() <= FP8_STEP * r.abs() + 2 ** -9).all(), msg
    assert (g == r).float().mean() > 0.99, msg


@pytest.mark.parametrize("case", range(NUM_CASES))
def test_fp8_gemm_kernel(case):
    rng, seed = new_rng()
    dtype = DTYPES[case % 3]
    m, n, k = _mnk(rng)
    w = torch.randn(n, k)
    scales = w.abs().amax(dim=1) / 448.0  # per-output-channel, as the builder does
    qweight = (w / scales[:, None]).to(torch.float8_e4m3fn)
    x, bias, out = _x_bias_out(m, n, k, dtype, case)
    got = fp8_gemm(x, qweight, scales, bias, out=out)
    ref = gemm_ref.fp8_gemm_ref(x, qweight, scales, bias)
    # both sides multiply the same E4M3 operands exactly and accumulate in fp32: the dtype's
    # tolerance applies (an activation rounded one FP8 step apart would show up as an error)
    assert_close(got, ref, dtype, f"seed={seed} m={m} n={n} k={k}")


def test_gemm_kernels_reject_bad_input():
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="group_size"):
        w4a16_gemm(x, torch.zeros(8, 32, dtype=torch.uint8), torch.ones(2, 8), torch.zeros(2, 8), 48)
    with pytest.raises(ValueError, match="in_features"):
        w8a16_gemm(torch.randn(2, 32), torch.zeros(8, 64, dtype=torch.int8), torch.ones(8))
    with pytest.raises(ValueError, match="qweight"):
        fp8_gemm(x, torch.zeros(8, 64, dtype=torch.int8), torch.ones(8))
    with pytest.raises(ValueError, match="scales"):  # grouped: scales must be (K // G, N)
        w8a16_gemm(x, torch.zeros(8, 64, dtype=torch.int8), torch.ones(8), group_size=32)
    with pytest.raises(ValueError, match="zeros"):
        w8a16_gemm(x, torch.zeros(8, 64, dtype=torch.int8), torch.ones(8), zeros=torch.zeros(8))
