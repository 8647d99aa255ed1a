"""The native int8 GEMM (kernels/cpu_gemm.c), int8 / int4 conversions and glue kernels vs the torch
references, and Int8Linear's use of them for batches, on every native CPU path (avx512, avx2,
generic: forced with TRITIUM_CPU_ISA by the cpu_path fixture, test ids name the path; a path the
host cannot run is skipped with the reason). Fresh random shapes and data every run."""
from __future__ import annotations

import random

import pytest
import torch

from seeds import fixed_seed
from tritium.kernels import cpu_native
from tritium.kernels.gemm_ref import w8a16_gemm_ref

pytestmark = pytest.mark.usefixtures("cpu_path")


def _case(rng):
    m, n, k = rng.randint(1, 20), rng.choice([1, 5, 16, 37, 100]), 32 * rng.randint(1, 24)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    scales = (torch.rand(n) / 50 + 1e-3).to(torch.bfloat16).float()
    return torch.randn(m, k).to(torch.bfloat16), q, scales


@pytest.mark.parametrize("case", range(8))
def test_w8a16_native_matches_reference(case):
    seed = fixed_seed()
    rng = random.Random(seed)
    torch.manual_seed(seed)
    x, q, scales = _case(rng)
    got = cpu_native.w8a16_gemm(x, q, scales)
    ref = w8a16_gemm_ref(x.float(), q, scales).float()
    # same products (bf16 x int8 is exact in float32); only the summation order differs
    tol = 1e-5 * (x.float().abs() @ (q.float().abs() * scales[:, None]).t()) + 1e-6
    assert ((got - ref).abs() <= tol).all(), f"seed={seed} shape={tuple(x.shape)}x{tuple(q.shape)}"
    # each row alone gives the same bits as inside the batch
    for r in range(x.shape[0]):
        assert torch.equal(cpu_native.w8a16_gemm(x[r:r + 1], q, scales)[0], got[r]), f"seed={seed} row {r}"


def test_int8_linear_uses_native_kernel_for_batches(monkeypatch):
    """bfloat16 int8 linear: the fused native kernel below DEQUANT_MIN_ROWS rows, the bf16 copy +
    native bf16 GEMM from there on, and the two give every row the same bits (batch invariance)."""
    from tritium.backend import quant
    from tritium.kernels import cpu_linear
    assert cpu_native.available()
    n, k = 48, 96
    lin = quant.Int8Linear(k, n, False, torch.bfloat16)
    lin.qweight.copy_(torch.randint(-127, 128, (n, k), dtype=torch.int8))
    lin.scales.copy_((torch.rand(n) / 50 + 1e-3).to(torch.bfloat16).float())
    calls = []
    real = cpu_native.w8a16_gemm
    monkeypatch.setattr(cpu_native, "w8a16_gemm", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    big = cpu_linear.DEQUANT_MIN_ROWS + 5
    x = torch.randn(big, k).to(torch.bfloat16)
    solo = torch.cat([lin(x[i:i + 1]) for i in range(big)])
    for m in (2, 7, 8, 33, big):
        ref = w8a16_gemm_ref(x[:m].float(), lin.qweight, lin.scales)
        got = lin(x[:m])
        assert got.dtype == torch.bfloat16 and torch.allclose(got.float(), ref.float(), rtol=1e-2, atol=1e-2)
        assert torch.equal(got, solo[:m]), m
    assert calls == [1] * big + [2, 7, 8, 33]


def test_int8_to_bf16_is_exact():
    q = torch.randint(-128, 128, (37, 70), dtype=torch.int8)  # 2590 values: 32-wide body and a tail
    assert torch.equal(cpu_native.int8_to_bf16(q), q.to(torch.bfloat16))


@pytest.mark.parametrize("t", [1, 3, 16])
def test_glue_kernels_match_references(t):
    """Residual add + RMSNorm, RoPE + KV write and SiLU-mul (cpu_glue.c) vs the torch references."""
    from tritium.kernels.kv_write_ref import kv_write_ref
    from tritium.kernels.rms_norm_ref import rms_norm_ref
    from tritium.kernels.rotary_ref import rope_cos_sin_cache, rope_inv_freq, rotary_ref, rotary_tables
    from tritium.kernels.silu_mul_ref import silu_mul_ref
    assert cpu_native.available()
    seed = fixed_seed()
    torch.manual_seed(seed)
    h, hq, hkv, d = 96, 6, 2, 64
    x, res, w = (torch.randn(t, h) * 3).bfloat16(), torch.randn(t, h).bfloat16(), (1 + torch.randn(h) / 4).bfloat16()
    for r in (None, res):
        got, got_res = cpu_native.add_rms_norm_bf16(x, w, 1e-5, r)
        ref, ref_res = rms_norm_ref(x, w, 1e-5, r)
        assert torch.equal(got_res, ref_res), f"seed={seed}"
        torch.testing.assert_close(got.float(), ref.float(), rtol=8e-3, atol=1e-3, msg=f"seed={seed}")
    g = (torch.randn(t, 2 * h) * 4).bfloat16()
    torch.testing.assert_close(cpu_native.silu_mul_bf16(g).float(), silu_mul_ref(g).float(), rtol=8e-3, atol=1e-3)
    qkv = torch.randn(t, (hq + 2 * hkv) * d).bfloat16()
    cache = rope_cos_sin_cache(rope_inv_freq(d, 10000.0), 500)
    pos = torch.randint(0, 500, (t,))
    slots = torch.randperm(8 * 16)[:t]
    kc, vc = torch.zeros(8, 16, hkv, d).bfloat16(), torch.zeros(8, 16, hkv, d).bfloat16()
    q = cpu_native.rotary_kv_write_bf16(qkv, hq, hkv, d, rotary_tables(pos, cache, torch.bfloat16), kc, vc, slots)
    rq, rk = rotary_ref(qkv[:, :hq * d].view(t, hq, d), qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d), pos, cache)
    kr, vr = torch.zeros_like(kc), torch.zeros_like(vc)
    kv_write_ref(rk, qkv[:, (hq + hkv) * d:].view(t, hkv, d), kr, vr, slots)
    # one bf16 rounding apart at most (the reference rounds each product of x1 cos - x2 sin)
    torch.testing.assert_close(q.float(), rq.float(), rtol=1.6e-2, atol=1.6e-2, msg=f"seed={seed}")
    torch.testing.assert_close(kc.float(), kr.float(), rtol=1.6e-2, atol=1.6e-2, msg=f"seed={seed}")
    assert torch.equal(vc, vr)


@pytest.mark.parametrize("act_order", [False, True])
def test_int4_to_bf16_and_int4_linear_prefill_path(act_order):
    """int4 -> bf16 dequantization (each value rounded once) vs the float32 reference, and
    Int4Linear's prefill-sized batches (bf16 copy + oneDNN) vs w4a16_gemm_ref."""
    from types import SimpleNamespace

    from tritium.backend import quant
    from tritium.kernels import cpu_linear
    from tritium.kernels.quant_layouts import dequantize_int4
    seed = fixed_seed()
    torch.manual_seed(seed)
    n, k, g = 40, 128, 32
    lin = quant.Int4Linear(k, n, False, torch.bfloat16, SimpleNamespace(group_size=g, act_order=act_order))
    lin.qweight.copy_(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8))
    # float16 group parameters, as engines store them (the kernels read them as stored)
    lin.scales = (torch.rand(k // g, n) / 10 + 1e-3).half()
    lin.zeros = (torch.randn(k // g, n) / 10).half()
    if act_order:
        lin.g_idx.copy_((torch.randperm(k) // g).to(torch.int32))
    exact = dequantize_int4(lin.qweight, lin.scales, lin.zeros, g, lin.g_idx, torch.float32)
    got = cpu_native.int4_to_bf16(lin.qweight, lin.scales, lin.zeros, g, lin.g_idx).float()
    assert ((got - exact).abs() <= exact.abs() * 2 ** -8 + 1e-30).all(), f"seed={seed}"  # within 1/2 bf16 ulp
    from tritium.kernels.gemm_ref import w4a16_gemm_ref
    for m in (cpu_linear.DEQUANT_MIN_ROWS - 1, cpu_linear.DEQUANT_MIN_ROWS + 3):
        x = torch.randn(m, k).bfloat16()
        ref = w4a16_gemm_ref(x.float(), lin.qweight, lin.scales, lin.zeros, g, lin.g_idx).float()
        torch.testing.assert_close(lin(x).float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item(),
                                   msg=lambda s: f"seed={seed} m={m}: {s}")


@pytest.mark.parametrize("zeros", [False, True])
def test_int8_gemms_have_the_bits_of_dequantize_then_bf16_gemm_alone_and_batched(zeros):
    """The fused int8 GEMMs (several rows: a block of channels dequantized to bf16, then the bf16
    GEMM's tiles) give every row the bits of the weight dequantized to bfloat16 by the conversion
    kernels and multiplied by tritium_bf16_gemm, whatever the row count (1 row: the one-row
    kernels), and stay within float32 summation error of the torch reference."""
    seed = fixed_seed()
    torch.manual_seed(seed)
    for m, n, k, g in ((2, 37, 96, 32), (7, 16, 576, 64), (16, 45, 192, 32), (20, 9, 64, 32)):
        x = torch.randn(m, k).to(torch.bfloat16)
        q = torch.randint(-128, 128, (n, k), dtype=torch.int8)
        s = torch.rand(k // g, n) * 0.01 + 1e-4
        z = torch.randn(k // g, n) * 0.01 if zeros else None
        s8 = (torch.rand(n) / 50 + 1e-3).to(torch.bfloat16).float()
        wb = cpu_native.int8g_to_bf16(q, s, z, g)
        got = cpu_native.w8g_gemm(x, q, cpu_native.pack_group_params(s, z), g)
        assert torch.equal(got, cpu_native.bf16_gemm(x, wb)), (seed, m, n, k)
        got8 = cpu_native.w8a16_gemm(x, q, s8)
        assert torch.equal(got8, cpu_native.bf16_gemm(x, q.to(torch.bfloat16)) * s8), (seed, m, n, k)
        ref = x.float() @ wb.float().t()
        assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item()), (seed, m, n, k)
        for r in range(m):
            assert torch.equal(cpu_native.w8g_gemm(x[r:r + 1], q, cpu_native.pack_group_params(s, z), g)[0],
                               got[r]), (seed, m, n, k, r)
            assert torch.equal(cpu_native.w8a16_gemm(x[r:r + 1], q, s8)[0], got8[r]), (seed, m, n, k, r)
