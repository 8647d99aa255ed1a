"""Group-wise and source-grid int8 / fp8 (kernels/quant_layouts.py's grouped layouts): the
layout's inverse, the builder's error against float, exactness on GGUF block grids made by the
`gguf` package (not by us), the CPU linear against dequantize-then-matmul, the native kernel
against the torch reference, the `_weight_int8pack_mm` width guard, and end-to-end engines
against transformers holding the GGUF's own dequantized weights."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file
from test_gguf_types import TYPES, roundtrip, write_gguf

from simple_generate import prompt_logits
from tritium.backend.config import LayerQuant
from tritium.backend.loader import load_engine
from tritium.backend.models.linear import make_linear
from tritium.builder.build import BuildOptions, build_engine
from tritium.builder.quant.gptq import HessianAccumulator
from tritium.builder.quant.gptq_fp8 import gptq_fp8_grouped
from tritium.builder.quant.quantize_fp8 import dequantize_fp8, quantize_fp8, quantize_fp8_grouped
from tritium.builder.quant.quantize_int8 import (dequantize_int8, quantize_int8, quantize_int8_grouped,
                                                 quantize_int8_source_grid)
from tritium.kernels import cpu_native
from tritium.kernels.gemm_ref import w8a16_gemm_ref
from tritium.kernels.int8pack_guard import int8pack_mm_safe, probe_width
from tritium.kernels.quant_layouts import dequantize_grouped


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def _gguf_grid(qtype, n=48, k=256, seed=0):
    """A weight on a GGUF block grid: the gguf package's quantize -> dequantize of random data."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    w[:, 7] *= 20  # an outlier input channel
    return torch.from_numpy(roundtrip(w, qtype).copy())


def test_grouped_layout_matches_its_definition():
    torch.manual_seed(0)
    n, k, g = 5, 96, 32
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    s, z = torch.rand(k // g, n), torch.randn(k // g, n)
    expect = torch.tensor([[q[i, j].item() * s[j // g, i].item() + z[j // g, i].item() for j in range(k)]
                           for i in range(n)])
    assert torch.allclose(dequantize_grouped(q, s, z, g), expect, atol=1e-6)
    assert torch.allclose(dequantize_grouped(q, s, None, g), expect - z.t().repeat_interleave(g, dim=1), atol=1e-5)
    with pytest.raises(ValueError, match="group_size 64"):
        dequantize_grouped(q, s, z, 64)


@pytest.mark.parametrize("kind", ["sym", "grid"])
def test_int8_grouped_round_trip_is_idempotent(kind):
    torch.manual_seed(1)
    w = torch.randn(40, 128)
    quant = (lambda x: (*quantize_int8_grouped(x, 32), None)) if kind == "sym" else (
        lambda x: quantize_int8_source_grid(x, 32))
    q, s, z = quant(w)
    assert q.dtype == torch.int8 and s.shape == (4, 40) and (z is None) == (kind == "sym")
    deq = dequantize_grouped(q, s, z, 32)
    # round to nearest: at most half a step per element
    assert ((deq - w).abs() <= s.t().repeat_interleave(32, dim=1) / 2 + 1e-6).all()
    q2, s2, z2 = quant(deq)
    assert torch.equal(q2, q)
    assert torch.allclose(dequantize_grouped(q2, s2, z2, 32), deq, atol=1e-6)


def test_group_wise_int8_beats_per_row_with_outliers():
    torch.manual_seed(2)
    w = torch.randn(64, 512) * 0.02
    w[torch.randint(0, 64, (40,)), torch.randint(0, 512, (40,))] = 1.0  # isolated outliers
    per_row = _rel(dequantize_int8(*quantize_int8(w)), w)
    g32 = _rel(dequantize_grouped(*quantize_int8_grouped(w, 32), None, 32), w)
    grid = _rel(dequantize_grouped(*quantize_int8_source_grid(w, 32), 32), w)
    assert g32 < 0.6 * per_row and grid < 0.6 * per_row


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q4_0, Q.Q8_0])
def test_source_grid_int8_is_exact_on_gguf_blocks(qtype):
    w = _gguf_grid(qtype)
    q, s, z = quantize_int8_source_grid(w, 32)
    # exact up to float32 rounding of scale * code + zero
    assert (dequantize_grouped(q, s, z, 32) - w).abs().max() <= 2e-6 * w.abs().max()
    # symmetric groups (amax / 127) of the same size are exact only on Q8_0, itself symmetric
    # int8 in blocks of 32; on the 4-bit grids they are off by up to half an int8 step
    qs, ss = quantize_int8_grouped(w, 32)
    sym_err = (dequantize_grouped(qs, ss, None, 32) - w).abs().max()
    assert (sym_err <= 2e-6 * w.abs().max()) == (qtype == Q.Q8_0)


def test_source_grid_fp8_is_exact_on_q4_blocks_and_beats_per_row_off_grid():
    for qtype in (Q.Q4_0, Q.Q4_1):
        wq = _gguf_grid(qtype, seed=int(qtype))
        q, s, z = quantize_fp8_grouped(wq, 32, asymmetric=True)
        assert q.dtype == torch.float8_e4m3fn and z is not None
        assert (dequantize_grouped(q, s, z, 32) - wq).abs().max() <= 2e-6 * wq.abs().max(), qtype
    w = _gguf_grid(Q.Q4_1)
    # GPTQ with the same group parameters keeps the grid (zero rounding error to feed back)
    x = torch.randn(512, 256)
    h = HessianAccumulator(256)
    h.add(x)
    qg, sg, zg = gptq_fp8_grouped(w, h.hessian(), 32, asymmetric=True)
    assert (dequantize_grouped(qg, sg, zg, 32) - w).abs().max() <= 2e-6 * w.abs().max()
    per_row = _rel(dequantize_fp8(*quantize_fp8(w)), w)
    assert per_row > 0.01
    # off any grid, groups still help a little (E4M3's 3 mantissa bits dominate)
    torch.manual_seed(3)
    wr = torch.randn(64, 256)
    wr[:, 5] *= 30
    g32 = _rel(dequantize_grouped(*quantize_fp8_grouped(wr, 32), 32), wr)
    assert g32 < _rel(dequantize_fp8(*quantize_fp8(wr)), wr)


def _load(mod, tensors):
    for name, t in tensors.items():
        mod._buffers[name] = t


@pytest.mark.parametrize("method", ["int8", "fp8"])
@pytest.mark.parametrize("asymmetric", [False, True])
@pytest.mark.parametrize("native", [True, False])
def test_grouped_linear_matches_dequantized_matmul(method, asymmetric, native, monkeypatch, cpu_path):
    """Decode-sized (1, 5 rows), mid (9) and prefill-sized (70) batches, with the native kernel
    and without it (the dense fallback)."""
    if not native:
        monkeypatch.setattr(cpu_native, "available", lambda: False)
    elif not cpu_native.available():
        pytest.fail("the native CPU kernels do not build on this machine")
    torch.manual_seed(4)
    n, k, g = 72, 192, 64
    w = torch.randn(n, k) * 0.1 + (0.05 if asymmetric else 0.0)
    if method == "int8":
        q, s, z = quantize_int8_source_grid(w, g) if asymmetric else (*quantize_int8_grouped(w, g), None)
    else:
        q, s, z = quantize_fp8_grouped(w, g, asymmetric)
    deq = dequantize_grouped(q, s, z, g)
    lin = make_linear(k, n, True, torch.bfloat16, LayerQuant(method, group_size=g, asymmetric=asymmetric))
    assert (lin.zeros is not None) == asymmetric and lin.scales.shape == (k // g, n)
    bias = torch.randn(n).to(torch.bfloat16)
    _load(lin, {"qweight": q, "scales": s, "bias": bias, **({"zeros": z} if z is not None else {})})
    lin.prepare_for_device("cpu")
    for m in (1, 5, 9, 70):
        x = torch.randn(m, k).to(torch.bfloat16)
        ref = x.float() @ deq.t() + bias.float()
        y = lin(x)
        assert y.dtype == torch.bfloat16 and y.shape == (m, n)
        assert _rel(y.float(), ref) < 1e-2, (m, _rel(y.float(), ref))


def test_grid_int8_linear_without_native_kernel_runs_packed_int4(monkeypatch):
    """On a 4-bit source grid (the gguf package's Q4_1) and without the native kernel, the
    grouped int8 linear runs torch's packed int4 GEMM (codes 17 q - 128 re-expressed as q), and
    still matches the exact layout to bfloat16 accuracy."""
    monkeypatch.setattr(cpu_native, "available", lambda: False)
    w = _gguf_grid(Q.Q4_1, n=64, k=256)
    q, s, z = quantize_int8_source_grid(w, 32)
    lin = make_linear(256, 64, False, torch.bfloat16, LayerQuant("int8", group_size=32, asymmetric=True))
    _load(lin, {"qweight": q, "scales": s, "zeros": z})
    lin.prepare_for_device("cpu")
    assert lin._get_packed().kind == "int4pack"
    for m in (1, 7, 70):
        x = torch.randn(m, 256).to(torch.bfloat16)
        assert _rel(lin(x).float(), x.float() @ w.t()) < 1e-2, m
    # off the grid (symmetric groups of a Q4_1 weight) the codes do not fit 4 bits: dense copy
    lin2 = make_linear(256, 64, False, torch.bfloat16, LayerQuant("int8", group_size=32))
    _load(lin2, dict(zip(("qweight", "scales"), quantize_int8_grouped(w, 32))))
    assert lin2._get_packed().kind == "dense_bf16"


@pytest.mark.parametrize("zeros", [False, True])
def test_native_grouped_gemm_matches_reference(zeros, cpu_path):
    """w8g_gemm and int8g_to_bf16 on each native CPU path (test ids name it)."""
    seed = int(torch.randint(0, 2 ** 31, ()).item())
    torch.manual_seed(seed)
    for m, n, k, g in ((1, 40, 64, 32), (8, 17, 192, 64), (13, 100, 256, 128), (3, 9, 96, 32)):
        q = torch.randint(-128, 128, (n, k), dtype=torch.int8)
        s = torch.rand(k // g, n) * 0.01 + 1e-4
        z = torch.randn(k // g, n) * 0.01 if zeros else None
        x = torch.randn(m, k).to(torch.bfloat16)
        got = cpu_native.w8g_gemm(x, q, cpu_native.pack_group_params(s, z), g)
        wb = cpu_native.int8g_to_bf16(q, s, z, g)
        assert torch.equal(wb, dequantize_grouped(q, s, z, g).to(torch.bfloat16)), (seed, n, k, g)
        # the kernel's contract: the weight rounded once to bfloat16, products summed in float32
        ref = x.float() @ wb.float().t()
        assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item()), (seed, m, n, k, g)
        # and within bfloat16 weight rounding of the exact layout
        exact = w8a16_gemm_ref(x.float(), q, s, None, z, g)
        assert _rel(got, exact) < 4e-3, (seed, m, n, k, g)


def test_int8pack_guard_matches_the_kernel_in_a_subprocess():
    """The rule agrees with what the kernel does, each width in its own process (crashes included)."""
    for k in (64, 72, 100):
        assert (probe_width(k) == "ok") == int8pack_mm_safe(k), k


def test_per_row_int8_linear_at_unsafe_width_falls_back():
    torch.manual_seed(5)
    n, k = 24, 72  # K = 72: the packed kernel crashes or is wrong here
    assert not int8pack_mm_safe(k)
    w = torch.randn(n, k)
    q, s = quantize_int8(w)
    lin = make_linear(k, n, False, torch.bfloat16, LayerQuant("int8"))
    _load(lin, {"qweight": q, "scales": s})
    for m in (1, 3):
        x = torch.randn(m, k).to(torch.bfloat16)
        ref = x.float() @ dequantize_int8(q, s).t()
        assert _rel(lin(x).float(), ref) < 1e-2


# ---- engines: GGUF sources with per-linear block types (test_gguf_types.TYPES) ----

@pytest.fixture(scope="module")
def gguf_src(tiny_checkpoint, tmp_path_factory):
    from transformers import AutoModelForCausalLM
    path = tiny_checkpoint("llama", hidden_size=64, intermediate_size=96, num_attention_heads=4,
                           num_key_value_heads=2, rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = tmp_path_factory.mktemp("int8grid") / "m.gguf"
    write_gguf(hf, out)
    return str(out), path


def _build(src, out, **kw):
    build_engine(BuildOptions(source=src, output=str(out), dtype="float32", progress=False, **kw))
    with open(os.path.join(out, "engine.json")) as f:
        return json.load(f)["quantization"]


def test_int8_plan_follows_source_blocks_and_group_size_flag(gguf_src, tmp_path):
    src, _ = gguf_src
    q = _build(src, tmp_path / "grid", quantization="int8")
    lay = q["layers"]
    assert lay["layers.0.o_proj"]["group_size"] == 32 and lay["layers.0.o_proj"]["asymmetric"] is True
    assert lay["layers.0.gate_up_proj"]["group_size"] == 32 and lay["layers.0.gate_up_proj"]["asymmetric"]
    # q is F16 (qkv off the grid) and down BF16: one scale per output channel
    assert lay["layers.0.qkv_proj"]["group_size"] is None and lay["layers.0.down_proj"]["group_size"] is None
    assert "int8 grouped" in q["layouts"] and "int8" in q["layouts"]
    t = load_file(str(tmp_path / "grid" / "rank0.safetensors"))
    assert t["layers.0.o_proj.scales"].shape == (2, 64) and t["layers.0.o_proj.zeros"].shape == (2, 64)
    assert t["layers.0.qkv_proj.scales"].shape == (128,) and "layers.0.qkv_proj.zeros" not in t
    g = _build(src, tmp_path / "g64", quantization="int8", group_size=64)["layers"]
    assert g["layers.0.o_proj"]["group_size"] == 64 and not g["layers.0.o_proj"]["asymmetric"]
    assert g["layers.0.down_proj"]["group_reason"] == "--group-size 64 does not divide 96 -> 32"
    r = _build(src, tmp_path / "row", quantization="int8", group_size=-1)["layers"]
    assert all(v["group_size"] is None for v in r.values())
    with pytest.raises(ValueError, match="--group-size 48 not supported for int8"):
        _build(src, tmp_path / "bad", quantization="int8", group_size=48)


def _hf_with_gguf_weights(hf_path):
    """transformers' Llama with every weight replaced by the gguf package's round trip of the
    types write_gguf used (the oracle of test_gguf_types)."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            qtype = next((t for key, t in TYPES.items() if key in name), Q.F32)
            qtype = Q.Q8_0 if "embed_tokens" in name else Q.Q4_1 if name == "lm_head.weight" else qtype
            if qtype == Q.BF16:
                new = p.detach().to(torch.bfloat16).float()
            else:
                new = torch.from_numpy(roundtrip(p.detach().numpy().astype(np.float32), qtype).copy())
            p.copy_(new.reshape(p.shape))
    return hf


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_source_grid_engine_matches_hf_on_gguf_weights(gguf_src, tmp_path, method):
    """Only the linears whose grid the format holds exactly quantized (int8: o Q4_1 and gate/up
    Q8_0/Q4_0; fp8: o Q4_1, since E4M3 cannot hold Q8_0's 255 levels): the engine's weights
    equal the GGUF's dequantized ones, and its logits match transformers holding those weights
    to bfloat16-activation accuracy, much closer than symmetric groups of 64 off the grid."""
    src, hf_path = gguf_src
    hf = _hf_with_gguf_weights(hf_path)
    keep = "*.qkv_proj,*.down_proj" + (",*.gate_up_proj" if method == "fp8" else "")
    # activation_quant none: transformers holds the weights in float (weight-only numerics)
    _build(src, tmp_path / "grid", quantization=method, exclude_modules=keep, activation_quant="none")
    _build(src, tmp_path / "g64", quantization=method, exclude_modules=keep, group_size=64, activation_quant="none")
    t = load_file(str(tmp_path / "grid" / "rank0.safetensors"))
    o = dequantize_grouped(t["layers.0.o_proj.qweight"], t["layers.0.o_proj.scales"], t["layers.0.o_proj.zeros"], 32)
    ref_o = hf.model.layers[0].self_attn.o_proj.weight.detach()
    assert (o - ref_o).abs().max() <= 2e-6 * ref_o.abs().max()
    ids = [5, 17, 923, 44, 300, 2, 81, 999, 13, 640, 7, 7, 250]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    errs = {}
    for tag in ("grid", "g64"):
        _, model, _ = load_engine(str(tmp_path / tag), "cpu")
        errs[tag] = _rel(prompt_logits(model, ids), ref)
    assert errs["grid"] < 1e-2 and errs["grid"] < 0.5 * errs["g64"], errs


def test_gptq_fp8_grouped_beats_rtn_on_output_error():
    """Off any grid, GPTQ's error feedback (static groups) lowers ||(W - Q) X|| below rounding to
    nearest with the same group scales, on correlated inputs."""
    torch.manual_seed(6)
    n, k = 32, 128
    w = torch.randn(n, k)
    x = torch.randn(1024, k) @ (torch.eye(k) + 0.3 * torch.randn(k, k))
    h = HessianAccumulator(k)
    h.add(x)
    rtn = dequantize_grouped(*quantize_fp8_grouped(w, 32), 32)
    gq_ = dequantize_grouped(*gptq_fp8_grouped(w, h.hessian(), 32, asymmetric=False), 32)
    err = {name: ((d - w) @ x.t()).norm().item() for name, d in (("rtn", rtn), ("gptq", gq_))}
    assert err["gptq"] < 0.9 * err["rtn"], err
