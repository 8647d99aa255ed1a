"""The symmetric int4 layout (llama.cpp Q4_0's grid: codes -8..7 times one float16 scale per group,
no zeros tensor; `--int4-layout symmetric`) end to end.

Oracles: Q4_0's definition written here from scratch (d = m / -8 for the block's value m of largest
magnitude, q = min(15, trunc(x / d + 8.5)), w = d (q - 8)) and the `gguf` package's own Q4_0
quantizer; the torch reference GEMM (gemm_ref) for the native kernels on every forced ISA path;
the activations quantized per 32-block by their definition for W4A8; a float model whose weights
are the engine's tensors dequantized with the layout's formula for whole engines."""
from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file
from test_gguf_types import roundtrip

from tritium.backend.loader import load_engine
from tritium.builder.build import BuildOptions, build_engine
from tritium.builder.quant.gptq import gptq_quantize
from tritium.builder.quant.quantize_int4 import quantize_int4
from tritium.kernels import cpu_linear, cpu_native
from tritium.kernels import i8dot_pack as ip
from tritium.kernels.gemm_ref import w4a16_gemm_ref
from tritium.kernels.quant_layouts import dequantize_int4, unpack_int4
from tests.test_quant_pipeline import DIMS, PROMPT, _dequantized_model, _logits


def _q4_0_reference(w: torch.Tensor):
    """Q4_0 from its definition, block by block of 32 along each row: (codes 0..15, float16 d)."""
    x = w.double().reshape(w.shape[0], -1, 32)
    idx = x.abs().argmax(dim=-1, keepdim=True)
    m = torch.gather(x, -1, idx)
    d = m / -8.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.clamp(torch.trunc(x * inv + 8.5), max=15)
    return q.reshape(w.shape).to(torch.uint8), d.squeeze(-1).float().half()


def _from_scratch_dequant(qweight: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """w[n, k] = d[k // 32, n] (q[n, k] - 8), q from byte k // 2 (low nibble = even k)."""
    n, kh = qweight.shape
    out = torch.empty(n, 2 * kh, dtype=torch.float64)
    b = qweight.to(torch.int64)
    out[:, 0::2] = (b & 15) - 8
    out[:, 1::2] = (b >> 4) - 8
    return (out * d.double().t().repeat_interleave(32, dim=1)).float()


def test_symmetric_layout_is_q4_0():
    torch.manual_seed(random.randrange(1 << 30))
    w = torch.randn(48, 256) * 0.05
    w[:, 7] *= 20  # an outlier channel
    q, s, z = quantize_int4(w, 32, symmetric=True)
    assert not bool(z.any()), "symmetric: zeros must be 0"
    q_ref, d_ref = _q4_0_reference(w)
    assert torch.equal(s.half(), d_ref.t()), "the scale is Q4_0's d (m / -8) in float16"
    codes = unpack_int4(q)
    diff = (codes.int() - q_ref.int()).abs()
    assert int(diff.max()) <= 1 and float((diff == 0).float().mean()) > 0.99  # only near-ties differ
    deq = dequantize_int4(q, s.half(), None, 32)
    assert torch.equal(deq, _from_scratch_dequant(q, s.half())), "layout != w = d (q - 8)"
    # round to nearest on the stored grid: never worse than Q4_0's own rounding
    err = (deq - w).abs()
    err_ref = (_from_scratch_dequant(_pack(q_ref), d_ref.t()) - w).abs()
    assert bool((err <= err_ref + 1e-7).all())


def _pack(codes: torch.Tensor) -> torch.Tensor:
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def test_symmetric_layout_stores_a_gguf_q4_0_tensor_bit_for_bit():
    """On a weight already on a Q4_0 grid (the gguf package's quantizer), RTN and GPTQ's symmetric
    grid land on it exactly: the largest magnitude of each block is d * -8."""
    rng = np.random.default_rng(random.randrange(1 << 30))
    w = torch.from_numpy(roundtrip((rng.standard_normal((40, 128)) * 0.05).astype(np.float32), Q.Q4_0).copy())
    q, s, _ = quantize_int4(w, 32, symmetric=True)
    assert torch.equal(dequantize_int4(q, s.half(), None, 32), w)
    x = torch.randn(256, 128)
    qg, sg, zg, _ = gptq_quantize(w, 2 * x.t() @ x / 256, 32, static_groups=True, symmetric=True)
    assert not bool(zg.any())
    assert torch.equal(dequantize_int4(qg, sg.half(), None, 32), w)


def _sym_weight(n, k, g=32):
    q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    s = (torch.rand(k // g, n) / 10 + 1e-3).half()  # float16 as stored; the kernels read it as is
    return q, s


@pytest.mark.parametrize("case", range(3))
def test_native_int4_kernels_without_zeros(cpu_path, case):
    """tritium_w4_gemm / tritium_int4_to_bf16 with zero == NULL: the torch reference within
    summation order, the same bits as an explicit all-zero zeros tensor, rows independent."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    n, k, g = rng.choice([8, 37, 100]), 32 * rng.randint(1, 12), 32 * rng.choice([1, 2])
    k = k // g * g or g
    q, s = _sym_weight(n, k, g)
    x = torch.randn(rng.randint(1, 12), k).bfloat16()
    exact = dequantize_int4(q, s, None, g)
    w16 = cpu_native.int4_to_bf16(q, s, None, g)
    assert ((w16.float() - exact).abs() <= exact.abs() * 2 ** -8).all(), f"{cpu_path} seed={seed}"
    assert torch.equal(w16, cpu_native.int4_to_bf16(q, s, torch.zeros_like(s), g))
    got = cpu_native.w4_gemm(x, q, s, None, g)
    assert torch.equal(got, cpu_native.w4_gemm(x, q, s, torch.zeros_like(s), g)), f"{cpu_path} seed={seed}"
    assert torch.equal(got, cpu_native.bf16_gemm(x, w16)), f"{cpu_path} seed={seed}: fused != dequantize + GEMM"
    ref = w4a16_gemm_ref(x.float(), q, s, None, g)
    # the kernel multiplies the weight rounded to bfloat16 (half an ulp: 2^-9 relative), then sums
    tol = (2 ** -9 + 1e-5) * (x.float().abs() @ exact.abs().t()) + 1e-6
    assert ((got - ref).abs() <= tol).all(), f"{cpu_path} seed={seed}"
    for r in range(x.shape[0]):
        assert torch.equal(cpu_native.w4_gemm(x[r:r + 1], q, s, None, g)[0], got[r]), f"{cpu_path} row {r}"


def test_w4a8_without_zeros_matches_definition(cpu_path):
    """The integer-dot W4A8 kernel on a symmetric int4 weight vs the activations quantized per
    32-block by their definition times the dequantized weight."""
    seed = random.randrange(1 << 30)
    torch.manual_seed(seed)
    n, k, g = 40, 192, 32
    q, s = _sym_weight(n, k, g)
    p = cpu_linear.pack_int4(q, s, None, g, None, torch.bfloat16, activation_quant="int8")
    assert p.kind == "i8dot"
    x = torch.randn(5, k).bfloat16()
    got = cpu_linear.run(x, p)
    qa, d = ip.quantize_q8_ref(x.float())
    xa = (qa.view(5, -1, 32).double() * d.double()[:, :, None]).view(5, k)
    ref = xa @ dequantize_int4(q, s, None, g).double().t()
    err = (got.double() - ref).abs().max() / ref.abs().max()
    assert err <= 1e-5, f"{cpu_path} seed={seed}: relative error {err:.3g}"


@pytest.fixture(scope="module")
def built(tiny_checkpoint, tmp_path_factory):
    cache = {}

    def make(**kw):
        key = tuple(sorted(kw.items()))
        if key not in cache:
            out = str(tmp_path_factory.mktemp("int4sym") / "engine")
            build_engine(BuildOptions(source=tiny_checkpoint("llama", **DIMS), output=out, dtype="float32",
                                      progress=False, calibration_samples=8, eval_tokens=0, **kw))
            cache[key] = out
        return cache[key]
    return make


@pytest.mark.parametrize("method", ["int4-rtn", "int4-gptq", "int4-awq"])
def test_symmetric_engine_builds_loads_and_matches_its_weights(built, method):
    # activation_quant none: checked against its dequantized weights (weight-only numerics)
    out = built(quantization=method, int4_layout="symmetric", activation_quant="none")
    t = load_file(os.path.join(out, "rank0.safetensors"))
    layers = json.load(open(os.path.join(out, "engine.json")))["quantization"]["layers"]
    lin = [n for n, lq in layers.items() if lq["method"] == "int4"]
    assert lin and all(layers[n]["symmetric"] for n in lin)
    assert not [n for n in t if n.endswith(".zeros") and n.startswith("layers.")], "symmetric: no zeros stored"
    cfg, model, _ = load_engine(out, "cpu")
    got, ref = _logits(model, PROMPT), _logits(_dequantized_model(out), PROMPT)
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max(), method


def test_symmetric_is_half_a_bit_smaller_and_the_default_keeps_zeros(built):
    sym, asym = built(quantization="int4-rtn", int4_layout="symmetric"), built(quantization="int4-rtn")
    rs = json.load(open(os.path.join(sym, "build_report.json")))["size"]
    ra = json.load(open(os.path.join(asym, "build_report.json")))["size"]
    ta = load_file(os.path.join(asym, "rank0.safetensors"))
    assert "layers.0.o_proj.zeros" in ta
    assert not json.load(open(os.path.join(asym, "engine.json")))["quantization"]["layers"]["layers.0.o_proj"]["symmetric"]
    for grp in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):  # groups of 32 here
        bs, ba = rs["groups"][grp]["bits_per_weight"], ra["groups"][grp]["bits_per_weight"]
        assert abs(bs - 4.5) < 1e-6 and abs(ba - 5.0) < 1e-6, (grp, bs, ba)


@pytest.mark.parametrize("kw, message", [
    (dict(quantization="int4-rtn", int4_layout="q4_0"), "--int4-layout 'q4_0' not supported; allowed: asymmetric, symmetric"),
    (dict(quantization="int8", int4_layout="symmetric"), "--int4-layout symmetric needs --quantization int4"),
])
def test_bad_int4_layout_is_refused(tiny_checkpoint, tmp_path, kw, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        build_engine(BuildOptions(source=tiny_checkpoint("llama", **DIMS), output=str(tmp_path / "e"),
                                  dtype="float32", progress=False, eval_tokens=0, **kw))


def test_native_decode_step_takes_symmetric_int4(native_step_engine, native_bf16, monkeypatch):
    """The native decode step's int4 kind with zero == NULL: bit-identical to the per-op path
    (test_native_step's scenario: a ragged prefill, a mixed step, then 12 decode steps of 4 rows)."""
    from tritium.backend.engine import LLMEngine
    from tritium.backend.models import native_step
    from test_native_step import _both_paths
    eng = LLMEngine(native_step_engine("llama-gqa", "int4", int4_layout="symmetric"), num_kv_blocks=8,
                    enable_prefix_caching=False)
    model = eng.runner.model
    assert native_step.refusal(model) is None, native_step.refusal(model)
    packed = native_step._packed(model.layers[0].qkv_proj)[0]
    assert packed.kind == "int4_native" and packed.tensors[2] is None  # symmetric: no zeros
    (ref_h, ref_kv), (got_h, got_kv), calls = _both_paths(model, monkeypatch)
    assert calls == [8] + [4] * 12
    for i, (a, b) in enumerate(zip(ref_h, got_h)):
        assert torch.equal(a, b), (native_bf16, i, (a.float() - b.float()).abs().max().item())
    for a, b in zip(ref_kv, got_kv):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), native_bf16


@pytest.fixture(scope="module")
def native_step_engine(tiny_checkpoint, tmp_path_factory):
    from test_native_step import engine_dir
    return engine_dir.__wrapped__(tiny_checkpoint, tmp_path_factory)
