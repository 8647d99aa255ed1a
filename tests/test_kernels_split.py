"""The per-op kernels' claimed work split (kernels/cpu_split.h: `schedule(dynamic, chunk)` instead
of fixed halves) on every ISA path (forced by the cpu_path fixture; ids name the path): at 1, 3,
16, 33 and 300 rows, on 1, 2 and 3 threads (3 threads on a 2-core host: the threads preempt each
other, so items land on different threads from call to call), every output has the one-thread
bits, and the one-thread result matches the torch reference written from each kernel's definition
(bf16 GEMM, int8 per-channel and grouped weight-only, int4 weight-only, W8A8 / W4A8 integer dot,
the int6 LM head, the glue ops)."""
from __future__ import annotations

import pytest
import torch

from seeds import fixed_seed
from tritium.kernels import cpu_native, head_pack
from tritium.kernels import i8dot_pack as ip
from tritium.kernels.rms_norm_ref import rms_norm_ref
from tritium.kernels.silu_mul_ref import silu_mul_ref

ROWS = (1, 3, 16, 33, 300)
N, K, G = 300, 256, 64  # N not a multiple of the 16 / 32-channel items: a short last item


def _on_threads(fn):
    """fn() on 1 thread, then on 2 and 3 (each result must have the 1-thread bits)."""
    n0 = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fn()
        for t in (2, 3, 2):
            torch.set_num_threads(t)
            got = fn()
            for a, b in zip(one if isinstance(one, tuple) else (one,), got if isinstance(got, tuple) else (got,)):
                assert torch.equal(a, b), f"{t} threads changed the bits"
        return one
    finally:
        torch.set_num_threads(n0)


def _close(got, ref, absx, absw, where, rel=2e-5):
    """|got - ref| within rel of the sum of |x| |w| per output (float32 sums of K products)."""
    tol = rel * (absx @ absw.t()) + 1e-6
    err = (got.double() - ref).abs()
    assert (err <= tol).all(), f"{where}: max err {err.max().item():.3g}"


def _x(m, seed):
    torch.manual_seed(seed)
    return torch.randn(m, K).to(torch.bfloat16)


@pytest.mark.parametrize("m", ROWS)
def test_dense_and_weight_only_gemms_keep_their_bits_on_any_thread_split(cpu_path, m):
    seed = fixed_seed()
    x = _x(m, seed)
    xd = x.double()
    where = f"path={cpu_path} rows={m} seed={seed}"
    w = (torch.randn(N, K) / K ** 0.5).to(torch.bfloat16)
    y = _on_threads(lambda: cpu_native.bf16_gemm(x, w))
    _close(y, xd @ w.double().t(), xd.abs(), w.double().abs(), f"bf16 {where}")
    y16 = _on_threads(lambda: cpu_native.bf16_gemm(x, w, torch.bfloat16))
    assert torch.equal(y16, y.to(torch.bfloat16)), f"bf16 out {where}"

    q = torch.randint(-127, 128, (N, K), dtype=torch.int8)
    s = torch.rand(N) / 50 + 1e-3
    y = _on_threads(lambda: cpu_native.w8a16_gemm(x, q, s))
    wq = q.double() * s.double()[:, None]
    _close(y, xd @ wq.t(), xd.abs(), wq.abs(), f"w8a16 {where}")

    gs, gz = torch.rand(K // G, N) / 50 + 1e-3, torch.randn(K // G, N) / 20
    params = cpu_native.pack_group_params(gs, gz)
    y = _on_threads(lambda: cpu_native.w8g_gemm(x, q, params, G))
    wg = (q.float() * gs.repeat_interleave(G, 0).t() + gz.repeat_interleave(G, 0).t()).to(torch.bfloat16).double()
    _close(y, xd @ wg.t(), xd.abs(), wg.abs(), f"w8g {where}", rel=1e-4)

    c4 = torch.randint(0, 16, (N, K), dtype=torch.uint8)
    w4 = (c4[:, 0::2] | (c4[:, 1::2] << 4)).contiguous()
    s4, z4 = (torch.rand(K // G, N) / 50 + 1e-3).half(), (torch.randn(K // G, N) / 20).half()
    y = _on_threads(lambda: cpu_native.w4_gemm(x, w4, s4, z4, G))
    d4 = ((c4.float() - 8) * s4.float().repeat_interleave(G, 0).t() + z4.float().repeat_interleave(G, 0).t())
    w4d = d4.to(torch.bfloat16).double()
    _close(y, xd @ w4d.t(), xd.abs(), w4d.abs(), f"w4 {where}", rel=1e-4)


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("bits", [8, 4])
def test_integer_dot_gemms_keep_their_bits_on_any_thread_split(cpu_path, m, bits):
    seed = fixed_seed()
    x = _x(m, seed)
    lo, hi = (-128, 128) if bits == 8 else (-8, 8)
    codes = torch.randint(lo, hi, (N, K))
    scales, zeros = torch.rand(K // G, N) / 40 + 1e-4, torch.randn(K // G, N) / 20
    w = ip.repack(codes, scales, zeros, G, bits)
    y = _on_threads(lambda: cpu_native.i8dot_gemm(x, w))
    ref = ip.i8dot_gemm_ref(x, w)
    q, d = ip.quantize_q8_ref(x)
    xhat = (q.view(m, -1, 32).double() * d.double()[:, :, None]).view(m, K)
    tol = 2e-6 * (xhat.abs() @ ip.dequantize(w).abs().t()) + 1e-30
    assert ((y.double() - ref).abs() <= tol).all(), f"path={cpu_path} rows={m} bits={bits} seed={seed}"


@pytest.mark.parametrize("m", ROWS)
def test_int6_head_keeps_its_bits_on_any_thread_split(cpu_path, m):
    seed = fixed_seed()
    x = _x(m, seed)
    hw = head_pack.repack6(torch.randint(-32, 32, (N, K)), (torch.rand(K // G, N) / 50 + 1e-3).half(), G)
    y = _on_threads(lambda: cpu_native.head6_gemm(x, hw))
    ref = head_pack.head6_gemm_ref(x, hw)
    err = (y.double() - ref).abs().max().item()
    assert err <= 1e-5 * ref.abs().max().item(), f"path={cpu_path} rows={m} seed={seed}: {err:.3g}"


@pytest.mark.parametrize("m", ROWS)
def test_glue_keeps_its_bits_on_any_thread_split(cpu_path, m):
    seed = fixed_seed()
    torch.manual_seed(seed)
    h = 96
    x, res, w = (torch.randn(m, h) * 3).bfloat16(), torch.randn(m, h).bfloat16(), (1 + torch.randn(h) / 4).bfloat16()
    got, got_res = _on_threads(lambda: cpu_native.add_rms_norm_bf16(x, w, 1e-5, res))
    ref, ref_res = rms_norm_ref(x, w, 1e-5, res)
    assert torch.equal(got_res, ref_res), f"path={cpu_path} rows={m} seed={seed}"
    torch.testing.assert_close(got.float(), ref.float(), rtol=8e-3, atol=1e-3, msg=f"seed={seed}")
    g = (torch.randn(m, 2 * h) * 4).bfloat16()
    got = _on_threads(lambda: cpu_native.silu_mul_bf16(g))
    torch.testing.assert_close(got.float(), silu_mul_ref(g).float(), rtol=8e-3, atol=1e-3, msg=f"seed={seed}")
