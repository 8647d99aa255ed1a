"""Quantize/dequantize round trips against the layouts' definitions, and quantized linears
against dequantize-then-matmul."""
from __future__ import annotations

import pytest
import torch

from tritium.backend.config import LayerQuant
from tritium.backend.models.linear import make_linear
from tritium.builder.quant.quantize_fp8 import dequantize_fp8, quantize_fp8
from tritium.builder.quant.quantize_int4 import choose_group_size, quantize_int4
from tritium.kernels.quant_layouts import dequantize_int4, pack_int4, unpack_int4
from tritium.builder.quant.quantize_int8 import dequantize_int8, quantize_int8


def test_int4_pack_layout_matches_definition():
    q = torch.randint(0, 16, (5, 12), dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.shape == (5, 6) and packed.dtype == torch.uint8
    # low nibble = even k, high nibble = odd k (the layout every reader relies on)
    assert torch.equal(packed & 0xF, q[:, 0::2]) and torch.equal(packed >> 4, q[:, 1::2])
    assert torch.equal(unpack_int4(packed), q)


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_round_trip_error_bound(group_size):
    torch.manual_seed(0)
    w = torch.randn(48, 256) * torch.rand(48, 1)
    qw, s, z = quantize_int4(w, group_size)
    assert qw.shape == (48, 128) and s.shape == z.shape == (256 // group_size, 48)
    deq = dequantize_int4(qw, s, z, group_size)
    # round to nearest on a grid of step `scale`: error <= scale / 2 per element
    step = s.t().repeat_interleave(group_size, dim=1)
    assert ((deq - w).abs() <= step / 2 + 1e-5).all()
    # formula of the layout: w = (q - 8) * scale + zero
    q = unpack_int4(qw).float()
    g = torch.arange(256) // group_size
    assert torch.allclose(deq, (q - 8) * s[g].t() + z[g].t())
    # a weight already on a group grid comes back exactly; re-quantizing is idempotent
    qw2, s2, z2 = quantize_int4(deq, group_size)
    assert torch.allclose(dequantize_int4(qw2, s2, z2, group_size), deq, atol=1e-5)


def test_int4_g_idx_dequantize():
    torch.manual_seed(1)
    w = torch.randn(8, 64)
    qw, s, z = quantize_int4(w, 32)
    perm = torch.randperm(64)
    g_idx = (torch.arange(64) // 32)[perm].to(torch.int32)
    deq = dequantize_int4(qw, s, z, 32, g_idx)
    q = unpack_int4(qw).float()
    expect = torch.stack([(q[:, k] - 8) * s[g_idx[k]] + z[g_idx[k]] for k in range(64)], dim=1)
    assert torch.allclose(deq, expect)


def test_int8_round_trip():
    torch.manual_seed(2)
    w = torch.randn(33, 70)
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and s.shape == (33,)
    # each scale is the smallest bfloat16 value >= amax / 127 (what the packed CPU GEMM reads,
    # so nothing is re-rounded at load), which keeps every code inside [-127, 127]
    exact = w.abs().amax(dim=1) / 127
    assert torch.equal(s.to(torch.bfloat16).float(), s) and (s >= exact).all()
    below = torch.nextafter(s.to(torch.bfloat16), torch.zeros((), dtype=torch.bfloat16)).float()
    assert (below < exact).all()
    assert (q.abs().amax(dim=1) >= 126).all() and (q.abs().amax(dim=1) <= 127).all()
    assert ((dequantize_int8(q, s) - w).abs() <= s[:, None] / 2 + 1e-6).all()


def test_fp8_round_trip():
    torch.manual_seed(3)
    w = torch.randn(17, 40)
    q, s = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn
    deq = dequantize_fp8(q, s)
    # E4M3 has 3 mantissa bits: relative rounding error <= 2^-4 for normal numbers
    rel = (deq - w).abs() / w.abs().clamp_min(1e-3)
    assert rel[w.abs() > s[:, None] * 2 ** -6].max() <= 2 ** -4 + 1e-6
    assert torch.allclose(q.float().abs().amax(dim=1), torch.full((17,), 448.0))


def test_choose_group_size():
    assert choose_group_size(576, 128) == 64
    assert choose_group_size(1536, 128) == 128
    assert choose_group_size(96, 128) == 32
    assert choose_group_size(100, 128) is None


def _load(mod, tensors):
    for name, t in tensors.items():
        mod._buffers[name] = t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act_order", [False, True])
def test_int4_linear_matches_dequantized_matmul(dtype, act_order):
    torch.manual_seed(4)
    n, k, g = 96, 256, 64
    w = torch.randn(n, k)
    qw, s, z = quantize_int4(w, g)
    tensors = {"qweight": qw, "scales": s, "zeros": z, "bias": torch.randn(n).to(dtype)}
    g_idx = None
    if act_order:  # a GPTQ-style scattered group assignment
        g_idx = (torch.arange(k) // g)[torch.randperm(k)].to(torch.int32)
        tensors["g_idx"] = g_idx
    lin = make_linear(k, n, True, dtype, LayerQuant("int4", group_size=g, act_order=act_order))
    _load(lin, tensors)
    lin.prepare_for_device("cpu")
    x = torch.randn(3, 5, k).to(dtype)
    ref = x.float() @ dequantize_int4(qw, s, z, g, g_idx).t() + tensors["bias"].float()
    y = lin(x)
    assert y.shape == (3, 5, n) and y.dtype == dtype
    # the CPU kernel runs in bf16: tolerance of bf16 accumulation over K=256
    assert torch.allclose(y.float(), ref, rtol=2e-2, atol=5e-2 * ref.abs().mean().item())


@pytest.mark.parametrize("method", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_fp8_linear_matches_dequantized_matmul(method, dtype):
    torch.manual_seed(5)
    n, k = 80, 192
    w = torch.randn(n, k)
    q, s = (quantize_int8 if method == "int8" else quantize_fp8)(w)
    deq = (dequantize_int8 if method == "int8" else dequantize_fp8)(q, s)
    lin = make_linear(k, n, False, dtype, LayerQuant(method))
    _load(lin, {"qweight": q, "scales": s})
    x = torch.randn(7, k).to(dtype)
    ref = x.float() @ deq.t()
    y = lin(x)
    assert y.dtype == dtype
    assert torch.allclose(y.float(), ref, rtol=2e-2, atol=5e-2 * ref.abs().mean().item())


def test_quant_linear_repacks_after_reload():
    torch.manual_seed(6)
    lin = make_linear(64, 32, False, torch.float32, LayerQuant("int4", group_size=32))
    x = torch.randn(2, 64)
    outs = []
    for _ in range(2):
        w = torch.randn(32, 64)
        qw, s, z = quantize_int4(w, 32)
        _load(lin, {"qweight": qw, "scales": s, "zeros": z})
        outs.append((lin(x), x @ dequantize_int4(qw, s, z, 32).t()))
    for y, ref in outs:  # bf16 kernel; a stale packed weight would be off by O(10)
        assert torch.allclose(y, ref, rtol=2e-2, atol=0.15)
    assert not torch.allclose(outs[0][0], outs[1][0], atol=1.0)
