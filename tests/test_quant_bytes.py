"""Engine format 3, "bytes that match the bits": 16-bit group scales / zeros, the int8 embedding
of int8 / fp8 builds, and the build report's bits per weight.

Oracles: the `gguf` package's own block quantizers (its dequantized Q4_0 / Q4_1 / Q8_0 weights
must come back bit for bit from the 16-bit layouts), dequantize-then-matmul in float32 for the
CPU linears and the embedding lookup, the safetensors file itself (its header's byte ranges and
its size) for the bits-per-weight arithmetic, and the same engine stored the format-2 way (float32
parameters) for backward compatibility."""
from __future__ import annotations

import json
import os
import shutil
import struct

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file, save_file
from test_gguf_types import roundtrip, write_gguf

from simple_generate import prompt_logits
from tp_utils import assert_vocab_shards
from tritium.backend.config import ENGINE_FORMAT_VERSION, LayerQuant
from tritium.backend.loader import load_engine
from tritium.backend.models.linear import make_linear
from tritium.builder.build import BuildOptions, build_engine
from tritium.builder.quant.param16 import compact_scales, param16_dtype
from tritium.builder.quant.quantize_fp8 import quantize_fp8_grouped
from tritium.builder.quant.quantize_int4 import quantize_int4
from tritium.builder.quant.quantize_int8 import quantize_int8, quantize_int8_grouped, quantize_int8_source_grid
from tritium.builder.report import size_summary
from tritium.kernels import cpu_native
from tritium.kernels.quant_layouts import dequantize_grouped, dequantize_int4

IDS = [5, 17, 923, 44, 300, 2, 81, 999, 13, 640, 7, 7, 250]


def _gguf_weight(qtype, n=40, k=256, seed=0, scale=0.05, outlier=True):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * scale).astype(np.float32)
    if outlier:
        w[:, 3] *= 25  # an outlier channel
    return torch.from_numpy(roundtrip(w, qtype).copy())


# ---- layouts: 16-bit parameters, exact on the gguf package's block grids ----

@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q4_0, Q.Q8_0])
def test_int8_source_grid_float16_params_are_exact_on_gguf_blocks(qtype):
    w = _gguf_weight(qtype)
    q, s, z = quantize_int8_source_grid(w, 32)
    assert q.dtype == torch.int8 and s.dtype == torch.float16 and z.dtype == torch.float16
    assert s.shape == z.shape == (256 // 32, 40)
    assert torch.equal(dequantize_grouped(q, s, z, 32), w), qtype  # bit for bit


def test_symmetric_int8_float16_scales_are_exact_on_q8_0_and_close_elsewhere():
    w = _gguf_weight(Q.Q8_0)
    q, s = quantize_int8_grouped(w, 32)
    assert s.dtype == torch.float16 and torch.equal(dequantize_grouped(q, s, None, 32), w)
    wr = torch.randn(40, 256) * 0.02
    q, s = quantize_int8_grouped(wr, 32)
    err = (dequantize_grouped(q, s, None, 32) - wr).abs()
    # within half a step of the (float16) scale, plus the clamp of the amax element
    step = s.float().t().repeat_interleave(32, dim=1)
    assert bool((err <= 0.5 * step * (1 + 2 ** -9) + 1e-12).all())


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q4_0])
def test_fp8_source_grid_float16_params_are_exact_on_4bit_blocks(qtype):
    w = _gguf_weight(qtype)
    q, s, z = quantize_fp8_grouped(w, 32, asymmetric=True)
    assert s.dtype == torch.float16 and z.dtype == torch.float16
    assert torch.equal(dequantize_grouped(q, s, z, 32), w)


def test_params_past_float16_range_are_bfloat16():
    w = torch.randn(8, 64) * 1e8  # amax / 127 above float16's 65504
    q, s = quantize_int8_grouped(w, 32)
    assert s.dtype == torch.bfloat16 and torch.isfinite(s.float()).all()
    rel = (dequantize_grouped(q, s, None, 32) - w).norm() / w.norm()
    assert rel < 1e-2
    assert param16_dtype(torch.tensor([1.0, -70000.0])) == torch.bfloat16
    assert param16_dtype(torch.tensor([1.0, -60000.0])) == torch.float16


def test_per_row_int8_scales_stored_bfloat16_only_when_exact():
    q, s = quantize_int8(torch.randn(16, 64))
    c = compact_scales(s)
    assert c.dtype == torch.bfloat16 and torch.equal(c.float(), s)
    odd = torch.tensor([0.1, 0.3])  # not bfloat16 values: kept float32
    assert compact_scales(odd).dtype == torch.float32


# ---- CPU linears with 16-bit parameters vs dequantize-then-matmul ----

@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("kind", ["int8-grid", "int8-sym", "fp8-grid", "int4"])
def test_cpu_linear_with_16bit_params_matches_dequantized_matmul(kind, native, monkeypatch):
    if not native:
        monkeypatch.setattr(cpu_native, "available", lambda: False)
    elif not cpu_native.available():
        pytest.fail("the native CPU kernels do not build on this machine")
    n, k, g = 48, 256, 32
    # no outlier channel: without the native kernel a 4-bit grid runs torch's packed int4 GEMM,
    # whose bfloat16 zero points shift a group with a large offset (docs/quantization.md)
    w = _gguf_weight(Q.Q4_1, n=n, k=k, seed=3, outlier=False)
    if kind == "int4":
        qw, s, z = quantize_int4(w, g)
        s, z = s.half(), z.half()
        tensors, lq = {"qweight": qw, "scales": s, "zeros": z}, LayerQuant("int4", group_size=g)
        deq = dequantize_int4(qw, s, z, g)
    else:
        method = kind.split("-")[0]
        if kind == "int8-sym":
            qw, s = quantize_int8_grouped(w, g)
            z = None
        elif method == "int8":
            qw, s, z = quantize_int8_source_grid(w, g)
        else:
            qw, s, z = quantize_fp8_grouped(w, g, asymmetric=True)
        tensors = {"qweight": qw, "scales": s, **({"zeros": z} if z is not None else {})}
        lq = LayerQuant(method, group_size=g, asymmetric=z is not None)
        deq = dequantize_grouped(qw, s, z, g)
    assert s.dtype == torch.float16
    for dtype in (torch.bfloat16, torch.float32):
        lin = make_linear(k, n, False, dtype, lq)
        for name, t in tensors.items():  # as DecoderLM.load_engine_weights keeps them: 16-bit
            lin._buffers[name] = t
        lin.prepare_for_device("cpu")
        for m in (1, 7, 70):
            x = torch.randn(m, k).to(dtype)
            ref = x.float() @ deq.t()
            y = lin(x).float()
            rel = ((y - ref).norm() / ref.norm()).item()
            assert rel < (1e-2 if dtype == torch.bfloat16 else 1e-5), (kind, dtype, m, rel)


# ---- engines ----

@pytest.fixture(scope="module")
def gguf_src(tiny_checkpoint, tmp_path_factory):
    from transformers import AutoModelForCausalLM
    path = tiny_checkpoint("llama", hidden_size=64, intermediate_size=96, num_attention_heads=4,
                           num_key_value_heads=2, rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = tmp_path_factory.mktemp("bytes") / "m.gguf"
    write_gguf(hf, out)  # embedding Q8_0, lm_head Q4_1, o Q4_1, gate / k Q8_0, up / v Q4_0, q F16, down BF16
    return str(out)


@pytest.fixture(scope="module")
def int8_engine(gguf_src, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("bytes") / "int8")
    build_engine(BuildOptions(source=gguf_src, output=out, dtype="bfloat16", quantization="int8",
                              progress=False, eval_tokens=0))
    return out


def _safetensors_ranges(path):
    """{tensor name: bytes} from the file's own header, and the header's length."""
    with open(path, "rb") as f:
        hlen = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(hlen))
    header.pop("__metadata__", None)
    return {n: v["data_offsets"][1] - v["data_offsets"][0] for n, v in header.items()}, hlen


def test_int8_engine_stores_16bit_params_and_an_int8_embedding(gguf_src, int8_engine):
    with open(os.path.join(int8_engine, "engine.json")) as f:
        cfg = json.load(f)
    assert cfg["format_version"] == ENGINE_FORMAT_VERSION == 3
    emb = cfg["quantization"]["layers"]["embed_tokens"]
    assert emb["method"] == "int8" and emb["group_size"] == 32 and "Q8_0" in emb["group_reason"]
    t = load_file(os.path.join(int8_engine, "rank0.safetensors"))
    assert "embed_tokens.weight" not in t and t["embed_tokens.qweight"].dtype == torch.int8
    assert t["embed_tokens.scales"].dtype == torch.float16 and t["embed_tokens.scales"].shape == (2, 1000)
    assert t["layers.0.o_proj.scales"].dtype == t["layers.0.o_proj.zeros"].dtype == torch.float16
    assert t["layers.0.qkv_proj.scales"].dtype == torch.bfloat16  # per row, bfloat16 values

def test_float32_int8_engine_keeps_the_gguf_grids_exactly(gguf_src, tmp_path):
    """A float32 build (weights not rounded to bfloat16 first): the Q8_0 embedding and the Q4_1
    o_proj come back bit for bit as the gguf package dequantizes them."""
    out = str(tmp_path / "f32")
    build_engine(BuildOptions(source=gguf_src, output=out, dtype="float32", quantization="int8",
                              progress=False, eval_tokens=0))
    t = load_file(os.path.join(out, "rank0.safetensors"))
    from tritium.builder.gguf_loader import GGUFCheckpoint
    ckpt = GGUFCheckpoint(gguf_src)
    emb = dequantize_grouped(t["embed_tokens.qweight"], t["embed_tokens.scales"], None, 32)
    assert torch.equal(emb, ckpt.get("model.embed_tokens.weight").float())
    o = dequantize_grouped(t["layers.0.o_proj.qweight"], t["layers.0.o_proj.scales"], t["layers.0.o_proj.zeros"], 32)
    assert torch.equal(o, ckpt.get("model.layers.0.self_attn.o_proj.weight").float())


def test_grouped_embedding_lookup_and_head_match_dequantized(int8_engine):
    _, model, _ = load_engine(int8_engine, "cpu")
    assert model.embed_tokens.scales.dtype == torch.float16  # kept 16-bit in memory
    t = load_file(os.path.join(int8_engine, "rank0.safetensors"))
    emb = dequantize_grouped(t["embed_tokens.qweight"], t["embed_tokens.scales"], None, 32)
    ids = torch.tensor(IDS[:6])
    assert torch.equal(model.embed(ids), emb[ids].to(torch.bfloat16))
    head = dequantize_grouped(t["lm_head.qweight"], t["lm_head.scales"], None, 32)
    h = torch.randn(5, 64).to(torch.bfloat16)
    ref = h.float() @ head.t()
    got = model.compute_logits(h)
    assert ((got - ref).norm() / ref.norm()).item() < 1e-2


def test_format_2_engine_with_float32_params_loads_and_gives_the_same_logits(int8_engine, tmp_path):
    """The same weights stored the format-2 way (every scale / zero float32): the runtime reads
    both and computes the same logits, bit for bit."""
    old = str(tmp_path / "old")
    shutil.copytree(int8_engine, old)
    t = load_file(os.path.join(old, "rank0.safetensors"))
    widened = {n: (v.float() if n.endswith((".scales", ".zeros")) else v) for n, v in t.items()}
    assert sum(v.dtype != widened[n].dtype for n, v in t.items()) > 0
    save_file(widened, os.path.join(old, "rank0.safetensors"))
    with open(os.path.join(old, "engine.json")) as f:
        cfg = json.load(f)
    cfg["format_version"] = 2
    with open(os.path.join(old, "engine.json"), "w") as f:
        json.dump(cfg, f)
    _, new_model, _ = load_engine(int8_engine, "cpu")
    _, old_model, _ = load_engine(old, "cpu")
    assert old_model.layers[0].o_proj.scales.dtype == torch.float32
    a, b = prompt_logits(new_model, IDS), prompt_logits(old_model, IDS)
    assert torch.equal(a, b)
    assert os.path.getsize(os.path.join(old, "rank0.safetensors")) > os.path.getsize(
        os.path.join(int8_engine, "rank0.safetensors"))


def _expected_weights(m):
    hd = m["head_dim"]
    h = m["hidden_size"]
    per_layer = {"qkv_proj": (m["num_heads"] + 2 * m["num_kv_heads"]) * hd * h, "o_proj": m["num_heads"] * hd * h,
                 "gate_up_proj": 2 * m["intermediate_size"] * h, "down_proj": m["intermediate_size"] * h}
    w = {k: v * m["num_layers"] for k, v in per_layer.items()}
    w["embed_tokens"] = m["vocab_size"] * h
    w["lm_head"] = 0 if m["tie_word_embeddings"] else m["vocab_size"] * h
    w["other"] = h * (2 * m["num_layers"] + 1)  # the RMSNorm weights
    return w


def _group_of(name):
    if name.startswith("layers.") and name.split(".")[2] in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        return name.split(".")[2]
    return next((g for g in ("embed_tokens", "lm_head") if name.startswith(g)), "other")


@pytest.mark.parametrize("quantization", ["int8", "int4-rtn", "none"])
def test_bits_per_weight_match_the_file(gguf_src, int8_engine, tmp_path, quantization):
    if quantization == "int8":
        eng = int8_engine
    else:
        eng = str(tmp_path / quantization)
        build_engine(BuildOptions(source=gguf_src, output=eng, dtype="bfloat16", quantization=quantization,
                                  progress=False, eval_tokens=0))
    with open(os.path.join(eng, "build_report.json")) as f:
        size = json.load(f)["size"]
    with open(os.path.join(eng, "engine.json")) as f:
        m = json.load(f)["model"]
    path = os.path.join(eng, "rank0.safetensors")
    ranges, hlen = _safetensors_ranges(path)
    assert size["bytes"] == sum(ranges.values()) == os.path.getsize(path) - 8 - hlen
    by_group = {}
    for n, b in ranges.items():
        by_group[_group_of(n)] = by_group.get(_group_of(n), 0) + b
    weights = _expected_weights(m)
    assert size["weights"] == sum(weights.values())
    for g, b in by_group.items():
        entry = size["groups"][g]
        assert entry["bytes"] == b and entry["weights"] == weights[g], g
        assert entry["bits_per_weight"] == pytest.approx(8 * b / weights[g], abs=1e-4)
    assert size["bits_per_weight"] == pytest.approx(8 * sum(ranges.values()) / sum(weights.values()), abs=1e-4)
    assert size["vs_bf16"] == pytest.approx(sum(ranges.values()) / (2 * sum(weights.values())), abs=1e-4)
    line = size_summary({"size": size})[0]
    assert f"{size['bits_per_weight']:.2f} bits per weight" in line and f"{size['vs_bf16']:.3f}x" in line
    if quantization == "none":
        assert size["vs_bf16"] == 1.0
    if quantization == "int8":
        g = size["groups"]
        # o_proj: Q4_1 source grid, K = 64: int8 codes + float16 scale and zero per 32 = 9 bits
        assert g["o_proj"]["bits_per_weight"] == 9.0
        # embedding / untied head: symmetric groups of 32, float16 scale = 8.5 bits
        assert g["embed_tokens"]["bits_per_weight"] == 8.5 and g["lm_head"]["bits_per_weight"] == 8.5
        # down_proj (BF16 in the GGUF, K = 96): one bfloat16 scale per row = 8 + 16 / 96 bits
        assert g["down_proj"]["bits_per_weight"] == pytest.approx(8 + 16 / 96, abs=1e-4)


def test_exclude_embed_tokens_keeps_the_embedding_float(gguf_src, tmp_path):
    out = str(tmp_path / "e")
    build_engine(BuildOptions(source=gguf_src, output=out, dtype="bfloat16", quantization="fp8",
                              exclude_modules="embed_tokens", progress=False, eval_tokens=0))
    t = load_file(os.path.join(out, "rank0.safetensors"))
    assert t["embed_tokens.weight"].dtype == torch.bfloat16 and "embed_tokens.qweight" not in t
    assert t["lm_head.qweight"].dtype == torch.int8  # the untied head is still int8
    _, model, _ = load_engine(out, "cpu")
    assert torch.isfinite(prompt_logits(model, IDS)).all()


def test_tensor_parallel_shards_the_grouped_embedding_by_vocabulary(gguf_src, int8_engine, tmp_path):
    out = str(tmp_path / "tp")
    build_engine(BuildOptions(source=gguf_src, output=out, dtype="bfloat16", quantization="int8",
                              tensor_parallel_size=2, progress=False, eval_tokens=0))
    assert_vocab_shards(int8_engine, out, lambda t: dequantize_grouped(t["embed_tokens.qweight"],
                                                                         t["embed_tokens.scales"], None, 32))


def test_int4_embedding_option_lookup_and_head_match_dequantized(gguf_src, tmp_path, monkeypatch):
    """--embedding-quantization int4: the embedding / LM head in the int4 layout (5 bits per weight
    at groups of 32); the lookup dequantizes the gathered rows and the head runs the int4 GEMM."""
    out = str(tmp_path / "e4")
    build_engine(BuildOptions(source=gguf_src, output=out, dtype="bfloat16", quantization="int4-rtn",
                              embedding_quantization="int4", progress=False, eval_tokens=0))
    with open(os.path.join(out, "engine.json")) as f:
        lay = json.load(f)["quantization"]["layers"]
    assert lay["embed_tokens"]["method"] == lay["lm_head"]["method"] == "int4"
    t = load_file(os.path.join(out, "rank0.safetensors"))
    assert t["embed_tokens.qweight"].shape == (1000, 32) and t["embed_tokens.scales"].dtype == torch.float16
    with open(os.path.join(out, "build_report.json")) as f:
        assert json.load(f)["size"]["groups"]["embed_tokens"]["bits_per_weight"] == 5.0
    _, model, _ = load_engine(out, "cpu")
    emb = dequantize_int4(t["embed_tokens.qweight"], t["embed_tokens.scales"], t["embed_tokens.zeros"], 32)
    ids = torch.tensor(IDS[:6])
    assert torch.equal(model.embed(ids), emb[ids].to(torch.bfloat16))
    head = dequantize_int4(t["lm_head.qweight"], t["lm_head.scales"], t["lm_head.zeros"], 32)
    h = torch.randn(5, 64).to(torch.bfloat16)
    ref = h.float() @ head.t()
    # the default folds the int4 zeros into the codes (each moved by up to 1/16 of a step,
    # docs/quantization.md); TRITIUM_I4_FOLD=0 runs the stored grid exactly
    assert ((model.compute_logits(h) - ref).norm() / ref.norm()).item() < 2e-2
    monkeypatch.setenv("TRITIUM_I4_FOLD", "0")
    _, exact, _ = load_engine(out, "cpu")
    assert ((exact.compute_logits(h) - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.parametrize("kw, match", [
    ({"quantization": "none", "embedding_quantization": "int8"}, "--embedding-quantization int8 needs --quantization"),
    ({"quantization": "auto", "embedding_quantization": "int4", "max_ppl_increase": 1.0},
     "picks the embedding's format itself"),
])
def test_embedding_quantization_flag_errors(gguf_src, tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        build_engine(BuildOptions(source=gguf_src, output=str(tmp_path / "x"), progress=False, **kw))


@pytest.mark.parametrize("method, rounding", [("int4-gptq", "GPTQ"), ("int4-awq", "AWQ's clip search")])
def test_int4_head_is_rounded_by_the_build_method(tiny_checkpoint, tmp_path, method, rounding):
    """--embedding-quantization int4 in a calibrated int4 build: the head is rounded by the
    method under the final hidden states' Hessian (its output error reported), and the runtime's
    logits are the dequantized head's."""
    from tritium.builder.quant.quantize_int4 import quantize_int4
    src = tiny_checkpoint("llama", hidden_size=96, intermediate_size=96)
    out = str(tmp_path / method)
    # activation_quant none: the logits are checked against the dequantized head (weight-only numerics)
    build_engine(BuildOptions(source=src, output=out, dtype="float32", quantization=method,
                              embedding_quantization="int4", calibration_samples=8, progress=False,
                              eval_tokens=0, activation_quant="none"))
    cfg, model, _ = load_engine(out, "cpu")
    hn = "embed_tokens" if cfg.model.tie_word_embeddings else "lm_head"
    with open(os.path.join(out, "build_report.json")) as f:
        layers = json.load(f)["quantization_report"]["layers"]
    head = layers[hn]
    assert head["method"] == "int4" and head["head"] and rounding in head["rounding"]
    assert 0 < head["rel_output_error"] < 0.05
    if hn == "lm_head":  # an untied embedding has no activations: round to nearest
        assert layers["embed_tokens"]["method"] == "int4" and "nearest" in layers["embed_tokens"]["rounding"]
    t = load_file(os.path.join(out, "rank0.safetensors"))
    deq = dequantize_int4(t[hn + ".qweight"], t[hn + ".scales"], t[hn + ".zeros"], 32)
    h = torch.randn(4, 96)
    torch.testing.assert_close(model.compute_logits(h), h @ deq.t(), rtol=1e-4, atol=1e-4)
