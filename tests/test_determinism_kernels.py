"""Batch invariance of the native CPU kernels (kernels/cpu_*.c through cpu_native / cpu_linear /
attention_cpu): a row's output bits do not depend on how many rows share the call, on where a
prefill is cut into chunks, or on whether its keys were written in this step or an earlier one.
Numerics are checked against the plain-torch references (gemm_ref, attention_ref, a float32
matmul). Random inputs from a seed fixed per test id (so a run is reproducible and no test is
flaky); TRITIUM_TEST_SEED=N shifts every seed to explore others (the seed is printed on failure).
"""
from __future__ import annotations

import pytest
import torch

from seeds import fixed_seed
from tritium.kernels import cpu_linear, cpu_native
from tritium.kernels.attention_cpu import paged_attention_cpu
from tritium.kernels.attention_metadata import AttentionMetadata
from tritium.kernels.attention_ref import paged_attention_ref

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _native(native_bf16):
    """Every test here runs once per native CPU path (forced; a path the CPU cannot run is skipped
    with the reason)."""


def _seed() -> int:
    seed = fixed_seed()
    torch.manual_seed(seed)
    return seed


def _solo(f, x):
    return torch.cat([f(x[i:i + 1]) for i in range(x.shape[0])])


@pytest.mark.parametrize("n,k", [(7, 45), (100, 72), (96, 160), (576, 1536), (64, 1100)])
def test_bf16_gemm_matches_float32_and_is_row_invariant(n, k):
    seed = _seed()
    w = (torch.randn(n, k) / k ** 0.5).bfloat16()
    x = torch.randn(70, k).bfloat16()
    y = cpu_native.bf16_gemm(x, w)
    ref = x.float() @ w.float().t()
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5, msg=lambda s: f"seed={seed}: {s}")
    solo = _solo(lambda a: cpu_native.bf16_gemm(a, w), x)
    for m in (2, 3, 4, 5, 6, 7, 12, 13, 17, 64, 70):  # every tile height (1-6 rows) and tails
        assert torch.equal(cpu_native.bf16_gemm(x[:m], w), solo[:m]), f"seed={seed} M={m}"


@pytest.mark.parametrize("n,k", [(7, 45), (40, 64), (100, 576)])
def test_bf16_gemm_bf16_output_is_torch_rounding_of_the_float32_output(n, k):
    """The kernel's own rounding (out_dtype bfloat16) gives the bits of torch's .to(bfloat16) on the
    float32 result, inf and NaN included, for the one-row and the tiled kernels."""
    seed = _seed()
    w = (torch.randn(n, k) / k ** 0.5).bfloat16()
    for m in (1, 6, 101):
        x = torch.randn(m, k).bfloat16()
        x[m // 2, 3] = float("nan")
        x[0, 1] = float("inf")
        want = cpu_native.bf16_gemm(x, w).to(torch.bfloat16)
        got = cpu_native.bf16_gemm(x, w, torch.bfloat16)
        assert got.dtype == torch.bfloat16
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"seed={seed} M={m}"
    with pytest.raises(ValueError, match="out_dtype must be float32 or bfloat16"):
        cpu_native.bf16_gemm(x, w, torch.float16)


def test_w4_gemm_equals_dequantize_then_bf16_gemm():
    seed = _seed()
    n, k, g = 40, 256, 64
    q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    s, z = (torch.rand(k // g, n) / 10 + 1e-3).half(), (torch.randn(k // g, n) / 10).half()  # as stored
    x = torch.randn(9, k).bfloat16()
    fused = cpu_native.w4_gemm(x, q, s, z, g)
    two_step = cpu_native.bf16_gemm(x, cpu_native.int4_to_bf16(q, s, z, g))
    assert torch.equal(fused, two_step), f"seed={seed}"
    assert torch.equal(_solo(lambda a: cpu_native.w4_gemm(a, q, s, z, g), x), fused), f"seed={seed}"


def _layer(method, k, n, dtype, **lq):
    from types import SimpleNamespace

    from tritium.backend.models.linear import make_linear
    lin = make_linear(k, n, False, dtype, SimpleNamespace(method=method, asymmetric=False, act_order=False, **lq))
    if method == "int4":
        lin.qweight.copy_(torch.randint(0, 256, lin.qweight.shape, dtype=torch.uint8))
        lin.scales = (torch.rand(lin.scales.shape) / 20 + 1e-3).half()  # float16, as engines store them
        lin.zeros = (torch.randn(lin.zeros.shape) / 20).half()
    else:
        qdtype = lin.qweight.dtype
        q = torch.randint(-127, 128, lin.qweight.shape) if qdtype == torch.int8 else torch.randn(lin.qweight.shape) * 40
        lin.qweight.copy_(q.to(qdtype))
        lin.scales.copy_(torch.rand(lin.scales.shape) / 50 + 1e-3)
    return lin


def _dequantized(lin) -> torch.Tensor:
    from tritium.kernels.quant_layouts import dequantize_grouped, dequantize_int4
    if isinstance(lin.qweight, torch.Tensor) and lin.qweight.dtype == torch.uint8:
        return dequantize_int4(lin.qweight, lin.scales, lin.zeros, lin.group_size, lin.g_idx, torch.float32)
    if lin.group_size is not None:
        return dequantize_grouped(lin.qweight, lin.scales, lin.zeros, lin.group_size, torch.float32)
    return lin.qweight.float() * lin.scales.float()[:, None]


CASES = [("int8", {}), ("int8", {"group_size": 32}), ("fp8", {}), ("int4", {"group_size": 32})]


@pytest.mark.parametrize("method,lq", CASES)
def test_bf16_quantized_linear_is_row_invariant_and_rounds_once(method, lq):
    """bf16 engine: one float32 product of the dequantized weight rounded once, within one bf16 step
    of dequantize-in-float32-then-multiply (the weight itself rounds to bf16 only where the format
    does: grouped / int4 values, 2^-9 relative); every row the same bits for 1..70 rows."""
    seed = _seed()
    k, n = 96, 48
    lin = _layer(method, k, n, torch.bfloat16, **lq)
    x = torch.randn(cpu_linear.DEQUANT_MIN_ROWS + 6, k).bfloat16()
    y = lin(x)
    ref = x.float() @ _dequantized(lin).t()
    step = ref.abs() * 2 ** -7 + 1e-6  # one bf16 step (8 significant bits) of the result
    mag = x.float().abs() @ _dequantized(lin).abs().t()
    # + float32 accumulation in another order: |error| <= K u sum |x w| (u = 2^-24; Higham,
    # "Accuracy and Stability of Numerical Algorithms", recursive summation), which is what
    # decides where the terms cancel and the result is small
    step = step + mag * k * 2 ** -24
    if method == "int4" or lq:  # + the weights' own bf16 rounding (half a step each, 2^-9)
        step = step + mag * 2 ** -9
    assert ((y.float() - ref).abs() <= step).all(), f"seed={seed}"
    solo = _solo(lin, x)
    for m in (2, 7, 8, 33, x.shape[0]):
        assert torch.equal(lin(x[:m]), solo[:m]), f"seed={seed} {method} M={m}"


@pytest.mark.parametrize("method,lq", CASES)
def test_float32_engine_quantized_linear_computes_in_float32(method, lq):
    seed = _seed()
    k, n = 96, 48
    lin = _layer(method, k, n, torch.float32, **lq)
    x = torch.randn(5, k)
    y = lin(x)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, x @ _dequantized(lin).t(), rtol=1e-5, atol=1e-5,
                               msg=lambda s: f"seed={seed}: {s}")


def test_dense_bf16_weights_default_to_the_native_gemm(monkeypatch):
    """Every dense bf16 weight packs for the native GEMM by default (any K, with or without
    `deterministic`); a bad TRITIUM_CPU_ONEDNN names the variable and its values."""
    monkeypatch.delenv(cpu_linear.ONEDNN_ENV, raising=False)
    for k in (72, 576, 1536):
        w = torch.randn(96, k).bfloat16()
        assert cpu_linear.pack_dense(w, deterministic=False).kind == "bf16_native"
        assert cpu_linear.pack_dense(w, deterministic=True).kind == "bf16_native"
    monkeypatch.setenv(cpu_linear.ONEDNN_ENV, "yes")
    with pytest.raises(ValueError, match="TRITIUM_CPU_ONEDNN must be 0 or 1"):
        cpu_linear.pack_dense(torch.randn(8, 64).bfloat16(), deterministic=False)


@pytest.mark.parametrize("k", [72, 576, cpu_linear.ONEDNN_INVARIANT_MAX_K])
def test_onednn_bf16_rows_invariant_up_to_the_measured_k(k, monkeypatch):
    """TRITIUM_CPU_ONEDNN=1 puts K <= ONEDNN_INVARIANT_MAX_K on oneDNN on the avx512 path, on the
    claim that its rows do not depend on M there; this checks the claim on this machine
    (SmolLM2-like widths). Without bf16 dot products (avx2, generic) the native GEMM takes every
    bf16 weight even then, and `deterministic` never uses oneDNN."""
    seed = _seed()
    monkeypatch.setenv(cpu_linear.ONEDNN_ENV, "1")
    for n in (96, 960, 3072):
        w = (torch.randn(n, k) / k ** 0.5).bfloat16()
        assert cpu_linear.pack_dense(w, deterministic=True).kind == "bf16_native"
        p = cpu_linear.pack_dense(w, deterministic=False)
        assert p.kind == ("onednn" if cpu_native.has_bf16_dot() else "bf16_native"), cpu_native.isa()
        x = torch.randn(70, k).bfloat16()
        solo = _solo(lambda a: cpu_linear.run(a, p), x)
        for m in (2, 9, 23, 64, 70):
            assert torch.equal(cpu_linear.run(x[:m], p), solo[:m]), f"seed={seed} N={n} K={k} M={m}"


def test_glue_kernels_rows_do_not_depend_on_the_step_size():
    from tritium.kernels import ops
    seed = _seed()
    h = 576
    x, res, w = (torch.randn(100, h).bfloat16() for _ in range(3))
    normed, _ = ops.rms_norm(x, w, 1e-5, res)
    assert torch.equal(normed[40:41], ops.rms_norm(x[40:41], w, 1e-5, res[40:41])[0]), f"seed={seed}"
    g = torch.randn(100, 2 * 1536).bfloat16()
    assert torch.equal(ops.silu_mul(g)[77:78], ops.silu_mul(g[77:78])), f"seed={seed}"


def _cache(seq_lens, bs, hkv, d, dtype=torch.bfloat16):
    """A shuffled paged cache holding K / V for each sequence's whole context."""
    need = [-(-s // bs) for s in seq_lens]
    ids = torch.randperm(sum(need) + 2).tolist()
    tables, kc = [], torch.zeros(len(ids), bs, hkv, d, dtype=dtype)
    vc = torch.zeros_like(kc)
    for s, nb in zip(seq_lens, need):
        t = [ids.pop() for _ in range(nb)]
        tables.append(t)
        for p in range(s):
            kc[t[p // bs], p % bs] = torch.randn(hkv, d)
            vc[t[p // bs], p % bs] = torch.randn(hkv, d)
    return kc, vc, tables


@pytest.mark.parametrize("hq,hkv,d,window", [(9, 3, 64, None), (6, 3, 16, None), (4, 1, 18, 7), (8, 8, 40, None)])
def test_native_attention_row_is_the_same_in_prefill_chunks_decode_and_batch(hq, hkv, d, window):
    """The last rows of a 37-token context: computed in one prefill, in chunks after cached context,
    as decodes, and beside other sequences: the same bits; and close to the reference."""
    seed = _seed()
    bs, total = 16, 37
    kc, vc, tables = _cache([total, 50], bs, hkv, d)
    q = torch.randn(total, hq, d).bfloat16()

    def run(query_lens, seq_lens, rows, tabs):
        meta = AttentionMetadata.build(query_lens, seq_lens, tabs, bs)
        return paged_attention_cpu(rows.contiguous(), kc, vc, meta, d ** -0.5, window)

    whole = run([total], [total], q, [tables[0]])
    ref = paged_attention_ref(q, kc, vc, AttentionMetadata.build([total], [total], [tables[0]], bs), d ** -0.5, window)
    torch.testing.assert_close(whole.float(), ref.float(), rtol=2e-2, atol=2e-2, msg=lambda s: f"seed={seed}: {s}")
    for cut in (1, 5, 20, 36):  # chunk [cut, total) after `cut` cached tokens
        chunk = run([total - cut], [total], q[cut:], [tables[0]])
        assert torch.equal(chunk, whole[cut:]), f"seed={seed} cut={cut}"
    for pos in (0, 16, 36):  # one decode row
        assert torch.equal(run([1], [pos + 1], q[pos:pos + 1], [tables[0]]), whole[pos:pos + 1]), f"seed={seed}"
    other = torch.randn(50, hq, d).bfloat16()  # beside another sequence's whole prefill
    both = run([total - 30, 50], [total, 50], torch.cat([q[30:], other]), tables)
    assert torch.equal(both[:total - 30], whole[30:]), f"seed={seed}"
