"""The bf16 GEMM's exact bits (kernels/cpu_gemm_bf16.c) on every native path, forced: a row's result
is the same whether it is computed alone (the one-row kernel) or in a call of 3, 16, 33 or 300 rows
(every tile height and the work items of many rows), in float32 and in bfloat16; and on the AVX2 and
portable paths it is exactly the sum order the kernels document, replayed here with float32 torch ops
(a bf16 x bf16 product is exact in float32, so an FMA on it is one rounded add): AVX2 8 lanes taking
the even and the odd k of each block of 16 (the even product first), the last K % 16 zero-padded,
then the fixed 8-lane tree; portable 16 lanes, lane i taking k = 16 j + i, then the fixed 16-lane tree.
The AVX-512 path (VDPBF16PS, whose internal rounding is the hardware's) is held to the float64
reference within float32 tolerance.
"""
from __future__ import annotations

import pytest
import torch

from seeds import fixed_seed
from tritium.kernels import cpu_native

pytestmark = pytest.mark.usefixtures("one_thread")

ROWS = (1, 3, 16, 33, 300)
# (N, K): SmolLM2's q/o (576x576), k/v (192x576), fused gate_up (3072x576), down (576x1536), and K
# tails (K % 16 != 0, K % 32 != 0)
SHAPES = ((576, 576), (192, 576), (3072, 576), (576, 1536), (37, 200), (50, 72))


def _seed() -> int:
    seed = fixed_seed()
    torch.manual_seed(seed)
    return seed


def _avx2_order(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The AVX2 sum order (cpu_gemm_bf16_avx2.h), in float32 torch ops."""
    m, k = x.shape
    pad = (-k) % 16
    xf = torch.nn.functional.pad(x.float(), (0, pad)).view(m, -1, 8, 2)  # (M, blocks, lane, even/odd)
    wf = torch.nn.functional.pad(w.float(), (0, pad)).view(w.shape[0], -1, 8, 2)
    acc = torch.zeros(m, w.shape[0], 8)
    for b in range(xf.shape[1]):
        for eo in (0, 1):
            acc = acc + xf[:, None, b, :, eo] * wf[None, :, b, :, eo]  # exact product, one rounding
    s4 = acc[..., :4] + acc[..., 4:]
    return (s4[..., 0] + s4[..., 2]) + (s4[..., 1] + s4[..., 3])


def _portable_order(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The portable path's sum order (cpu_gemm_bf16_generic.h), in float32 torch ops."""
    m, k = x.shape
    xf, wf = x.float(), w.float()
    acc = torch.zeros(m, w.shape[0], 16)
    for k0 in range(0, k, 16):
        n = min(16, k - k0)  # the last lanes of a short block take nothing
        acc[..., :n] = acc[..., :n] + xf[:, None, k0:k0 + n] * wf[None, :, k0:k0 + n]
    s8 = acc[..., :8] + acc[..., 8:]
    s4 = s8[..., :4] + s8[..., 4:]
    return (s4[..., 0] + s4[..., 2]) + (s4[..., 1] + s4[..., 3])


@pytest.mark.parametrize("n,k", SHAPES)
def test_rows_have_the_one_row_bits_at_every_row_count(cpu_path, n, k):
    seed = _seed()
    w = (torch.randn(n, k) / k ** 0.5).bfloat16()
    x = torch.randn(max(ROWS), k).bfloat16()
    solo = torch.cat([cpu_native.bf16_gemm(x[i:i + 1], w) for i in range(x.shape[0])])
    for m in ROWS:
        y = cpu_native.bf16_gemm(x[:m], w)
        assert torch.equal(y, solo[:m]), f"{cpu_path} seed={seed} M={m} N={n} K={k}"
        y16 = cpu_native.bf16_gemm(x[:m], w, torch.bfloat16)
        assert torch.equal(y16.view(torch.int16), solo[:m].to(torch.bfloat16).view(torch.int16)), \
            f"{cpu_path} seed={seed} M={m} N={n} K={k} (bf16 output)"
    ref = (x.double() @ w.double().t()).float()
    torch.testing.assert_close(solo, ref, rtol=1e-5, atol=1e-5, msg=lambda s: f"{cpu_path} seed={seed}: {s}")


@pytest.mark.parametrize("n,k", SHAPES)
def test_huge_page_kernels_keep_the_bits(cpu_path, n, k):
    """With the weights declared on 2 MiB pages (tritium_i8dot_huge_pages(1), as the native step
    does after kernels/hugepages.py moved them) the one-row GEMV runs other tiles (avx512: 1 x 4
    tiles instead of the 16-channel row kernel) and asks for lines with other hints: the same bits
    as without, at 1-6 rows, in float32 and bfloat16."""
    seed = _seed()
    w = (torch.randn(n, k) / k ** 0.5).bfloat16()
    x = torch.randn(6, k).bfloat16()
    lib = cpu_native._lib()
    plain = [cpu_native.bf16_gemm(x[:m], w) for m in range(1, 7)]
    plain16 = [cpu_native.bf16_gemm(x[:m], w, torch.bfloat16) for m in range(1, 7)]
    lib.tritium_i8dot_huge_pages(1)
    try:
        huge = [cpu_native.bf16_gemm(x[:m], w) for m in range(1, 7)]
        huge16 = [cpu_native.bf16_gemm(x[:m], w, torch.bfloat16) for m in range(1, 7)]
    finally:
        lib.tritium_i8dot_huge_pages(0)
    for m in range(6):
        assert torch.equal(huge[m], plain[m]), f"{cpu_path} seed={seed} M={m + 1} N={n} K={k}"
        assert torch.equal(huge16[m].view(torch.int16), plain16[m].view(torch.int16)), \
            f"{cpu_path} seed={seed} M={m + 1} N={n} K={k} (bf16 output)"
    ref = (x[:1].double() @ w.double().t()).float()
    torch.testing.assert_close(huge[0], ref, rtol=1e-5, atol=1e-5, msg=lambda s: f"{cpu_path} seed={seed}: {s}")


@pytest.mark.parametrize("path", ("avx2", "generic"))
@pytest.mark.parametrize("n,k", ((40, 576), (24, 1536), (37, 200), (50, 72)))
def test_every_output_is_the_documented_sum_order(path, n, k):
    """AVX2 and portable paths, forced (the AVX-512 path's VDPBF16PS rounds inside the instruction,
    as the hardware does: it is held to the float64 reference and its one-row bits above)."""
    from conftest import forced_cpu_path
    seed = _seed()
    w = (torch.randn(n, k) / k ** 0.5).bfloat16()
    x = torch.randn(max(ROWS), k).bfloat16()
    want = (_avx2_order if path == "avx2" else _portable_order)(x, w)
    with forced_cpu_path(path):
        for m in ROWS:
            got = cpu_native.bf16_gemm(x[:m], w)
            assert torch.equal(got, want[:m]), f"{path} seed={seed} M={m} N={n} K={k}"


def test_gemm_bench_prints_its_figures(capsys):
    """client/bench/gemm_bench.py on the paths this host runs, tiny: a line per shape with a figure
    per kernel, and a clear error for a path the host cannot run."""
    from tritium.client.bench import gemm_bench
    from tritium.kernels import cpu_isa
    paths = [p for p in ("avx512", "avx2") if p in cpu_isa.runnable()]
    if not paths:
        pytest.skip(f"gemm_bench times the x86 SIMD paths; this CPU runs {', '.join(cpu_isa.runnable())}")
    assert gemm_bench.main(["--paths", *paths, "--rows", "3", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "peak GFLOP/s on this core" in out
    lines = [ln for ln in out.splitlines() if ln.strip().startswith("3 ")]
    assert len(lines) == len(gemm_bench.SHAPES), out
    for ln in lines:
        assert len([v for v in ln.split() if v.replace(".", "", 1).isdigit()]) >= 1 + len(paths) + 1, ln
    with pytest.raises(SystemExit):
        gemm_bench.main(["--paths", "avx512", "--base-kernels", "/nonexistent/dir"])
