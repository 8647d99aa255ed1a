"""int4 W4A8 with the zero folded into the integer codes (kernels/i8dot_pack.py `fold`, the
kernels' FOLD4 layout): the zero of each block rounded to a multiple of 1/8 of its scale, so the
kernels' block sums are exact integers with no float zero term. Checked on every ISA path (forced
with TRITIUM_CPU_ISA by the cpu_path fixture; test ids name the path) against the weights written
from the definition (w = s (c + round(8 z / s) / 8), independent of the packing code), row by row
(batch invariance), and the choice of when to fold. Fresh random data every run; the seed is in
each failure message."""
from __future__ import annotations

import pytest
import torch

from seeds import fixed_seed
from tritium.kernels import cpu_native
from tritium.kernels import i8dot_pack as ip


def _weights(n, k, g=32):
    """Codes -8..7, float16 scales, zeros with z / s in the foldable range (a Q4_1-like grid:
    the block's minimum at or below 0), one all-zero block (s = z = 0)."""
    c = torch.randint(-8, 8, (n, k))
    s = (torch.rand(k // g, n) / 40 + 1e-4).half()
    z = (s.float() * (torch.rand(k // g, n) * 16.8 - 8)).half()
    s[0, 0], z[0, 0] = 0, 0
    return c, s, z


def _definition(c, s, z, g=32):
    """float64 (N, K) weights of the folded layout from the definition: the zero rounded (half to
    even) to a multiple of s / 8, computed on the float16 values as stored."""
    sd, zd = s.double().t(), z.double().t()  # (N, K / G)
    zr = torch.where(sd != 0, torch.round(8 * zd / torch.where(sd != 0, sd, torch.ones_like(sd))) / 8 * sd,
                     torch.zeros_like(sd))
    return c.double() * sd.repeat_interleave(g, 1) + zr.repeat_interleave(g, 1)


def test_fold_layout_is_the_definition():
    """repack folds foldable int4 zeros (r divided by 8, zc in 0..135), and the folded weight's
    dequantization and reference product are those of the definition's weights."""
    seed = fixed_seed()
    torch.manual_seed(seed)
    n, k = 37, 256
    c, s, z = _weights(n, k)
    w = ip.repack(c, s, z, 32, 4)
    assert w.fold and w.kernel_bits == ip.FOLD4 and w.z.dtype == torch.int16, f"seed={seed}"
    assert int(w.z.min()) >= 0 and int(w.z.max()) <= 135, f"seed={seed}"
    exact = _definition(c, s, z)
    assert torch.allclose(ip.dequantize(w), exact, rtol=0, atol=1e-12), f"seed={seed}"
    # the rounding moves a zero by at most s / 16
    classic = c.double() * s.double().t().repeat_interleave(32, 1) + z.double().t().repeat_interleave(32, 1)
    assert ((exact - classic).abs() <= s.double().t().repeat_interleave(32, 1) / 16 + 1e-12).all(), f"seed={seed}"
    x = torch.randn(5, k)
    q, xd = ip.quantize_q8_ref(x)
    xhat = (q.view(5, -1, 32).double() * xd.double()[:, :, None]).view(5, k)
    assert torch.allclose(ip.i8dot_gemm_ref(x, w), xhat @ exact.t(), rtol=1e-12, atol=1e-12), f"seed={seed}"


def test_fold_only_where_every_block_allows_it():
    """A zero that rounds outside -8 .. 8.875 scales, or a zero-scale block with a nonzero zero, keeps the
    float zero for the whole layer; fold=False, symmetric int4 and int8 never fold."""
    torch.manual_seed(3)
    n, k = 16, 64
    c, s, z = _weights(n, k)
    far = z.clone()
    far[1, 5] = s[1, 5] * 9  # one block out of range
    assert not ip.repack(c, s, far, 32, 4).fold
    dz = z.clone()
    dz[0, 0] = 0.5  # scale 0, zero 0.5
    assert not ip.repack(c, s, dz, 32, 4).fold
    assert not ip.repack(c, s, z, 32, 4, fold=False).fold
    assert not ip.repack(c, s, None, 32, 4).fold
    assert not ip.repack(torch.randint(-128, 128, (n, k)), s, z, 32, 8).fold
    assert ip.repack(c, s, z, 32, 4).fold


def test_folded_gemm_matches_definition_and_rows_are_independent(cpu_path):
    """The native GEMM on folded weights against the reference (exact integer block dots, float
    rescaling order only), on a tail panel and a long K; each row gives the same bits alone, in 3,
    9, 13, 16, 17, 33 and 300 rows, first, last and mid-tile (avx512 passes over a panel with up to
    16 rows, two 8-row tiles, and a 1-8 row remainder: every split of a call)."""
    seed = fixed_seed()
    torch.manual_seed(seed)
    for n, k in ((37, 1536), (70, 320)):
        c, s, z = _weights(n, k)
        w = ip.repack(c, s, z, 32, 4)
        where = f"path={cpu_path} seed={seed} n={n} k={k}"
        assert w.fold, where
        x = torch.randn(300, k) * torch.rand(300, 1) * 4
        x[7, :32] = 0  # an all-zero activation block
        full = cpu_native.i8dot_gemm(x, w)
        ref = ip.i8dot_gemm_ref(x, w)
        q, xd = ip.quantize_q8_ref(x)
        xhat = (q.view(300, -1, 32).double() * xd.double()[:, :, None]).view(300, k)
        tol = 2e-6 * (xhat.abs() @ ip.dequantize(w).abs().t()) + 1e-30
        err = (full.double() - ref).abs()
        assert (err <= tol).all(), f"{where}: max err {err.max().item():.3g}"
        for m in (1, 2, 3, 9, 13, 16, 17, 33):
            for r0 in (0, 300 - m, 131):
                got = cpu_native.i8dot_gemm(x[r0:r0 + m], w)
                assert torch.equal(got, full[r0:r0 + m]), f"{where} rows {r0}..{r0 + m - 1}"


def test_folded_extreme_codes_stay_exact(cpu_path):
    """The byte range's ends: nibbles 0 and 15 with zc 0 and 135 (codes -128 and 127) against
    activations at +-127 give the reference's sums (no saturation on any path)."""
    n, k = 16, 64
    c = torch.full((n, k), -8)
    c[:, 1::2] = 7
    s = torch.full((k // 32, n), 0.01).half()
    z = (s.float() * torch.tensor([-8.0, 8.875])[:, None]).half()
    w = ip.repack(c, s, z, 32, 4)
    assert w.fold and int(w.z.min()) == 0 and int(w.z.max()) == 135
    x = torch.ones(2, k)
    x[1, ::2] = -1
    got = cpu_native.i8dot_gemm(x, w).double()
    ref = ip.i8dot_gemm_ref(x, w)
    assert torch.allclose(got, ref, rtol=1e-6, atol=1e-9), f"path={cpu_path}: {got[:, :2]} vs {ref[:, :2]}"


def test_fold_switch_at_load(monkeypatch):
    """TRITIUM_I4_FOLD (read when an int4 linear is packed): 1 (default) folds, 0 keeps the float
    zero term and the stored grid exactly; any other value is refused naming the variable."""
    from tritium.kernels import ops
    torch.manual_seed(4)
    n, k = 32, 128
    c, s, z = _weights(n, k)
    u = (c + 8).to(torch.uint8).view(n, k // 2, 2)
    buf = {"qweight": u[:, :, 0] | (u[:, :, 1] << 4), "scales": s, "zeros": z}
    for v, want in (("1", True), ("0", False)):
        monkeypatch.setenv("TRITIUM_I4_FOLD", v)
        w = ops.pack_cpu_linear("int4", buf, torch.bfloat16, 32, activation_quant="int8").tensors[0]
        assert w.fold is want, f"TRITIUM_I4_FOLD={v}"
    exact = c.double() * s.double().t().repeat_interleave(32, 1) + z.double().t().repeat_interleave(32, 1)
    assert torch.allclose(ip.dequantize(w), exact, rtol=2 ** -10, atol=1e-9)
    monkeypatch.setenv("TRITIUM_I4_FOLD", "yes")
    with pytest.raises(ValueError, match="TRITIUM_I4_FOLD"):
        ops.pack_cpu_linear("int4", buf, torch.bfloat16, 32, activation_quant="int8")


def test_folded_avx2_gives_the_avx512_bits():
    """AVX2 forms the folded block sum as T / 8 in one exact float FMA and multiplies by 8 d (the
    real product T d), AVX-512 converts the integer T: the same float steps, so the same bits at 1,
    2, 3, 9, 16, 25 and 40 rows (avx512's 16-row passes and their remainders; paths skipped with
    the reason where this CPU cannot run them)."""
    from conftest import forced_cpu_path
    seed = fixed_seed()
    torch.manual_seed(seed)
    n, k = 37, 640
    c, s, z = _weights(n, k)
    w = ip.repack(c, s, z, 32, 4)
    x = torch.randn(40, k) * 3
    got = {}
    for path in ("avx512", "avx2"):
        with forced_cpu_path(path):
            got[path] = [cpu_native.i8dot_gemm(x[:m], w) for m in (1, 2, 3, 9, 16, 25, 40)]
    for a, b in zip(got["avx512"], got["avx2"]):
        assert torch.equal(a, b), f"seed={seed} rows={a.shape[0]}: max diff {(a - b).abs().max().item():.3g}"
