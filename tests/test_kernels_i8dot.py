"""The integer-dot W8A8 / W4A8 GEMM (kernels/cpu_gemm_i8dot.c) on every ISA path (forced with
TRITIUM_CPU_ISA by the cpu_path fixture; test ids name the path) against the torch reference
written from the definition (kernels/i8dot_pack.i8dot_gemm_ref: activations quantized per
32-block, exact integer block dots, rescaled), odd shapes, and batch invariance. Fresh random
shapes and data every run; the seed is in each failure message."""
from __future__ import annotations

import ctypes
import random

import pytest
import torch

from seeds import fixed_seed
from tritium.kernels import cpu_native
from tritium.kernels import i8dot_pack as ip


def _case(rng, bits):
    m, n, k = rng.randint(1, 21), rng.choice([1, 3, 16, 37, 70]), 32 * rng.randint(1, 13)
    if bits == 8:
        group = rng.choice([None, 32, 64, 96])
        codes = torch.randint(-128, 128, (n, k))
    else:
        group = rng.choice([32, 64, 128])
        codes = torch.randint(-8, 8, (n, k))
    if group is not None and k % group:
        group = 32
    shape = (n,) if group is None else (k // group, n)
    scales = torch.rand(shape) / 40 + 1e-4
    zeros = torch.randn(shape) / 20 if group is not None and rng.random() < 0.7 else None
    x = torch.randn(m, k) * rng.choice([0.05, 1.0, 30.0])
    x[:, rng.randrange(k)] *= 50  # an outlier channel
    if m > 1:
        x[rng.randrange(m), :32] = 0  # an all-zero block: scale 0, codes 0
    return x, ip.repack(codes, scales, zeros, group, bits)


@pytest.mark.parametrize("bits", [8, 4])
def test_i8dot_gemm_matches_reference(cpu_path, bits):
    path, kern = cpu_path, cpu_native
    for _ in range(6):
        seed = fixed_seed()
        rng = random.Random(seed)
        torch.manual_seed(seed)
        x, w = _case(rng, bits)
        where = f"path={path} seed={seed} x={tuple(x.shape)} w={w.shape} bits={bits} zeros={w.z is not None}"
        q, d = ip.quantize_q8_ref(x)
        kq, kd, ks = kern.q8_quantize(x)
        assert torch.equal(kq, q) and torch.equal(kd, d), f"activation codes differ from the definition: {where}"
        assert torch.equal(ks, q.view(q.shape[0], -1, 32).sum(dim=2, dtype=torch.int32)), where
        got = kern.i8dot_gemm(x, w).double()
        ref = ip.i8dot_gemm_ref(x, w)
        # exact integer dots: only float32 rescaling and summation order differ
        xhat = q.view(q.shape[0], -1, 32).double() * d.double()[:, :, None]
        tol = 2e-6 * (xhat.view(x.shape).abs() @ ip.dequantize(w).abs().t()) + 1e-30
        assert ((got - ref).abs() <= tol).all(), f"{where}: max err {(got - ref).abs().max().item():.3g}"
        # a row alone gives the bits it gets inside the batch
        for r in {0, x.shape[0] - 1, x.shape[0] // 2}:
            assert torch.equal(kern.i8dot_gemm(x[r:r + 1], w)[0], got[r].float()), f"{where}: row {r}"


@pytest.mark.parametrize("bits", [8, 4])
def test_i8dot_close_to_weight_only(bits):
    """The activation rounding costs about what int8 per-32 rounding should: relative error
    around 1/254 of each block's range, far from a wrong result."""
    kern = cpu_native
    assert kern.available()
    torch.manual_seed(0)
    n, k = 64, 512
    codes = torch.randint(-128, 128, (n, k)) if bits == 8 else torch.randint(-8, 8, (n, k))
    w = ip.repack(codes, torch.rand(k // 32, n) / 40 + 1e-3, torch.randn(k // 32, n) / 50, 32, bits)
    x = torch.randn(5, k)
    exact = x.to(torch.bfloat16).double() @ ip.dequantize(w).t()
    got = kern.i8dot_gemm(x, w).double()
    rel = (got - exact).norm() / exact.norm()
    assert 1e-4 < rel < 2e-2, f"relative error {rel:.3g} of W{bits}A8 against the unquantized activations"


def test_repack_is_exact_and_checks_its_input():
    """dequantize(repack(c, s, z)) = c s + z up to float16 rounding of s / r and z / r (r a power of
    two), exact for bfloat16 per-channel scales (the int8 layout's)."""
    torch.manual_seed(1)
    n, k = 24, 128
    c = torch.randint(-128, 128, (n, k))
    s = (torch.rand(n) / 30 + 1e-5).to(torch.bfloat16).float()
    w = ip.repack(c, s, None, None, 8)
    assert w.z is None and torch.equal(ip.dequantize(w), c.double() * s.double()[:, None])
    s4, z4 = torch.rand(k // 64, n) / 10, torch.randn(k // 64, n)
    c4 = torch.randint(-8, 8, (n, k))
    w4 = ip.repack(c4, s4, z4, 64, 4)
    assert torch.equal(ip.signed_codes(w4), c4.to(torch.int32))
    exact = c4.double() * s4.double().t().repeat_interleave(64, 1) + z4.double().t().repeat_interleave(64, 1)
    assert ((ip.dequantize(w4) - exact).abs() <= 2 ** -11 * (c4.abs().double() * s4.double().t().repeat_interleave(64, 1)
                                                              + z4.double().abs().t().repeat_interleave(64, 1))).all()
    with pytest.raises(ValueError, match="codes must lie"):
        ip.repack(c4 * 3, s4, z4, 64, 4)
    with pytest.raises(ValueError, match="multiples of 32"):
        ip.repack(torch.zeros(4, 48, dtype=torch.int32), torch.ones(4), None, None, 8)
    with pytest.raises(ValueError, match="group parameters"):
        ip.repack(c4, s4.t(), None, 64, 4)


@pytest.mark.parametrize("bits", [8, 4])
def test_panel_layout_matches_its_definition(bits):
    """The packed bytes read element by element as i8dot_pack's docstring defines them (panels
    of 16 channels, vector i of a block = k 4 i .. 4 i + 3 of each channel; int4 high nibble =
    k + 16), the padded channels of the last panel code 0 with scale 0, and signed_codes inverts."""
    torch.manual_seed(2)
    n, k = 21, 64
    c = torch.randint(-128, 128, (n, k)) if bits == 8 else torch.randint(-8, 8, (n, k))
    s = torch.rand(n) / 30 + 1e-3
    w = ip.repack(c, s, None, None, bits) if bits == 8 else ip.repack(c, s[None, :].expand(k // 32, n), None, 32, 4)
    assert w.codes.shape == (2, k // 32, bits, 16, 4) and w.d.shape == (2, k // 32, 16)
    rng = random.Random(fixed_seed())
    for _ in range(200):
        ch, kk = rng.randrange(32), rng.randrange(k)
        p, j, b, i, e = ch // 16, ch % 16, kk // 32, (kk % 32) // 4, kk % 4
        want = int(c[ch, kk]) if ch < n else 0
        if bits == 8:
            got = int(w.codes[p, b, i, j, e].view(torch.int8))
        else:
            byte = int(w.codes[p, b, i % 4, j, e])
            got = ((byte >> 4) if (kk % 32) >= 16 else (byte & 0x0F)) - 8
        assert got == want, f"channel {ch} k {kk}: {got} != {want}"
        assert (float(w.d[p, b, j]) == 0.0) == (ch >= n)
    assert torch.equal(ip.signed_codes(w), c.to(torch.int32))


@pytest.mark.parametrize("bits", [8, 4])
def test_i8dot_few_row_passes_give_the_batched_bits(cpu_path, bits):
    """One or two rows take each panel in one pass (both halves of a block together on AVX2),
    three or more one pass per half: every row count 1..10 gives each row the bits it gets in a
    batch of 10, on a tail panel (N = 37) and a long K (the weight prefetch runs past the panel),
    and the batch stays at the reference; the same with the weights declared on 2 MiB pages
    (tritium_i8dot_huge_pages(1): other prefetch distances, avx512 int8 at two rows its own loop
    without software prefetch), symmetric and asymmetric."""
    seed = fixed_seed()
    torch.manual_seed(seed)
    n, k = 37, 1536
    lo, hi = (-128, 128) if bits == 8 else (-8, 8)
    codes, scales = torch.randint(lo, hi, (n, k)), torch.rand(k // 32, n) / 40 + 1e-4
    x = torch.randn(10, k)
    lib = cpu_native._lib()
    for zeros in (torch.randn(k // 32, n) / 20, None):
        w = ip.repack(codes, scales, zeros, 32, bits)
        full = cpu_native.i8dot_gemm(x, w)
        ref = ip.i8dot_gemm_ref(x, w)
        where = f"path={cpu_path} seed={seed} zeros={zeros is not None}"
        assert torch.allclose(full.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item()), where
        for huge in (0, 1):
            lib.tritium_i8dot_huge_pages(huge)
            try:
                for m in range(1, 11):
                    for r0 in (0, 10 - m):
                        got = cpu_native.i8dot_gemm(x[r0:r0 + m], w)
                        assert torch.equal(got, full[r0:r0 + m]), f"{where} huge={huge} rows {r0}..{r0 + m - 1}"
            finally:
                lib.tritium_i8dot_huge_pages(0)


@pytest.mark.parametrize("bits", [8, 4])
def test_i8dot_row_tiles_give_every_row_its_own_bits(cpu_path, bits):
    """The GEMM's scratch interleaves the rows of a tile of 8: a row gives the same bits alone, in
    3, 16, 33 (a partial last tile) and 300 rows, wherever it sits in the call (first, last or
    mid-tile position), symmetric and asymmetric weights; the 300-row call stays at the reference."""
    seed = fixed_seed()
    torch.manual_seed(seed)
    n, k = 37, 320
    lo, hi = (-128, 128) if bits == 8 else (-8, 8)
    x = torch.randn(300, k) * torch.rand(300, 1) * 4
    for zeros in (torch.randn(k // 32, n) / 20, None):
        w = ip.repack(torch.randint(lo, hi, (n, k)), torch.rand(k // 32, n) / 40 + 1e-4, zeros, 32, bits)
        where = f"path={cpu_path} seed={seed} bits={bits} zeros={zeros is not None}"
        full = cpu_native.i8dot_gemm(x, w)
        ref = ip.i8dot_gemm_ref(x, w)
        assert torch.allclose(full.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item()), where
        for m in (1, 3, 16, 33):
            for r0 in (0, 300 - m, 131):
                got = cpu_native.i8dot_gemm(x[r0:r0 + m], w)
                assert torch.equal(got, full[r0:r0 + m]), f"{where} rows {r0}..{r0 + m - 1}"


def test_i8dot_peak_probe_counts_its_work(cpu_path):
    """tritium_i8dot_peak (i8dot_bench --gops) reports the multiply-adds it ran on the x86 paths
    (12 chains x 64 per round with VPDPBUSD, x 32 with AVX2) and none on the portable path."""
    lib = cpu_native._lib()
    lib.tritium_i8dot_peak.argtypes = [ctypes.c_int64, ctypes.c_int64]
    lib.tritium_i8dot_peak.restype = ctypes.c_int64
    per_round = {"avx512": 12 * 64, "avx2": 12 * 32, "generic": 0}[cpu_path]
    for form in (8, 4):
        assert lib.tritium_i8dot_peak(1000, form) == 1000 * per_round, f"path={cpu_path} form={form}"
