"""The int6 embedding / LM head (`--embedding-quantization int6`, kernels/quant_layouts.INT6_LAYOUT):
four 6-bit codes in three bytes with a bfloat16 scale per vocabulary row.

Oracles: the layout's definition (w = q * scales[n], written here from the docs, not from the
packer), torch float32 matmuls of the dequantized weight, and the per-row int8 engine that holds
the same values (its integer-dot head must give the int6 head's bits, its weight-only head those of
the int6 head with TRITIUM_HEAD_DOT=0). The head kernel itself: tests/test_head_int6.py.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from tp_utils import assert_vocab_shards
from tritium.backend.config import LayerQuant
from tritium.backend.loader import load_engine
from tritium.backend.models.linear import make_linear
from tritium.builder.build import BuildOptions, build_engine
from tritium.kernels.quant_layouts import dequantize_int6, pack_int6, unpack_int6

IDS = [5, 17, 923, 44, 300, 2, 81, 999, 13, 640, 7, 7, 250]


def _decode_by_definition(packed: torch.Tensor) -> torch.Tensor:
    """Codes from the documented bit layout, one weight at a time (independent of unpack_int6)."""
    out = []
    for row in packed.tolist():
        codes = []
        for j in range(0, len(row), 3):
            v = row[j] + (row[j + 1] << 8) + (row[j + 2] << 16)
            codes += [((v >> (6 * i)) & 63) - 32 for i in range(4)]
        out.append(codes)
    return torch.tensor(out)


def test_pack_round_trip_and_documented_bit_layout():
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-32, 32, (7, 24), generator=g)
    q[0, :4] = torch.tensor([-32, 31, 0, -1])  # the extremes
    packed = pack_int6(q)
    assert packed.dtype == torch.uint8 and packed.shape == (7, 18)
    assert torch.equal(unpack_int6(packed).long(), q)
    assert torch.equal(_decode_by_definition(packed), q)
    # u = q + 32: (-32, 31, 0, -1) -> (0, 63, 32, 31) -> 0 | 63 << 6 | 32 << 12 | 31 << 18
    v = 63 << 6 | 32 << 12 | 31 << 18
    assert packed[0, :3].tolist() == [v & 255, (v >> 8) & 255, v >> 16]
    s = torch.rand(7) + 0.1
    torch.testing.assert_close(dequantize_int6(packed, s), q.float() * s[:, None], rtol=0, atol=0)
    sg = torch.rand(3, 7) + 0.1  # groups of 8: scales (K // G, N)
    torch.testing.assert_close(dequantize_int6(packed, sg, 8),
                               q.float() * sg.t().repeat_interleave(8, dim=1), rtol=0, atol=0)


def test_pack_refuses_codes_out_of_range_and_bad_widths():
    with pytest.raises(ValueError, match="-32..31"):
        pack_int6(torch.full((2, 8), 32))
    with pytest.raises(ValueError, match="multiple of 4"):
        pack_int6(torch.zeros(2, 6, dtype=torch.int64))
    with pytest.raises(ValueError, match="multiple of 3"):
        unpack_int6(torch.zeros(2, 5, dtype=torch.uint8))


def _int6_linear(n, k, dtype, group=None, seed=1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-32, 32, (n, k), generator=g)
    if group is None:  # bfloat16 per row, float16 (K // G, N) per group
        s = (torch.rand(n, generator=g) * 0.02 + 1e-3).to(torch.bfloat16)
    else:
        s = (torch.rand(k // group, n, generator=g) * 0.02 + 1e-3).half()
    lin = make_linear(k, n, False, dtype, LayerQuant("int6", group_size=group))
    packed = pack_int6(q)
    lin._buffers["qweight"] = packed  # as DecoderLM.load_engine_weights does: kept as stored
    lin._buffers["scales"] = s
    lin.prepare_for_device("cpu")
    full = s.float()[:, None] if group is None else s.float().t().repeat_interleave(group, dim=1)
    return lin, q.float() * full


@pytest.mark.parametrize("group", [None, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int6_head_gemm_matches_torch_reference_on_each_cpu_path(cpu_path, dtype, group):
    """The head GEMM on the forced native path vs x W^T in float32 from the definition; in
    bfloat16 (the native batch-invariant kernels) rows computed alone give the same bits as the
    batch (docs/determinism.md; float32 engines run torch's GEMMs, not batch-invariant)."""
    n, k = 200, 96
    lin, w = _int6_linear(n, k, dtype, group)
    x = torch.randn(9, k).to(dtype)
    y = lin(x)
    ref = x.float() @ w.t()
    rel = ((y.float() - ref).norm() / ref.norm()).item()
    assert rel < (1e-2 if dtype == torch.bfloat16 else 1e-5), (cpu_path, dtype, rel)
    for i in (0, 4, 8) if dtype == torch.bfloat16 else ():
        assert torch.equal(lin(x[i:i + 1]), y[i:i + 1]), (cpu_path, i)


def test_int6_linear_refuses_a_width_not_a_multiple_of_4():
    with pytest.raises(ValueError, match="multiple of 4"):
        make_linear(30, 8, False, torch.float32, LayerQuant("int6"))


@pytest.fixture(scope="module")
def int6_engine(tiny_checkpoint, tmp_path_factory):
    src = tiny_checkpoint("llama", hidden_size=128, intermediate_size=96, num_attention_heads=4,
                          num_key_value_heads=2)
    out = str(tmp_path_factory.mktemp("int6") / "e6")
    build_engine(BuildOptions(source=src, output=out, dtype="bfloat16", quantization="int4-rtn",
                              embedding_quantization="int6", progress=False, eval_tokens=0))
    return out


def test_int6_engine_stores_the_layout_and_reports_its_bits(int6_engine):
    with open(os.path.join(int6_engine, "engine.json")) as f:
        q = json.load(f)["quantization"]
    heads = [n for n in ("embed_tokens", "lm_head") if n in q["layers"]]
    assert heads and all(q["layers"][n]["method"] == "int6" for n in heads)
    assert "int6" in q["layouts"]
    t = load_file(os.path.join(int6_engine, "rank0.safetensors"))
    for n in heads:
        assert q["layers"][n]["group_size"] == 64  # hidden 128: float16 scales per 64
        assert t[n + ".qweight"].dtype == torch.uint8 and t[n + ".qweight"].shape == (1000, 96)
        assert t[n + ".scales"].dtype == torch.float16 and t[n + ".scales"].shape == (2, 1000)
        codes = unpack_int6(t[n + ".qweight"])
        assert int(codes.min()) >= -32 and int(codes.max()) <= 31 and int(codes.abs().max()) >= 31
    with open(os.path.join(int6_engine, "build_report.json")) as f:
        size = json.load(f)["size"]["groups"]
    assert size["embed_tokens"]["bits_per_weight"] == 6.25  # 6 + 16 / 64
    assert size["embed_tokens"]["weights"] == 1000 * 128


def _head_dot(model, mode: str) -> None:
    """The embedding / LM head of `model` alone on the integer-dot kernels ("int8") or not."""
    for mod in (model.embed_tokens, model.lm_head):
        if mod is not None:
            mod.activation_quant, mod._packed = mode, None


def test_int6_engine_equals_the_engine_of_its_dequantized_weights(int6_engine, tmp_path, monkeypatch):
    """The same engine with the embedding / head stored as per-row int8 holding the unpacked
    codes (the values the int6 layout defines): the same lookup; the int6 head on its 6-bit codes
    (W6A8, the default of bfloat16 engines) gives the bits of the int8 engine's integer-dot head
    (W8A8 on the same values: the same activation codes, exact integer sums, the same float32
    steps), and with TRITIUM_HEAD_DOT=0 the bits of its weight-only head (the old widened path);
    both agree with the float32 dequantized matrix."""
    with open(os.path.join(int6_engine, "engine.json")) as f:
        cfg = json.load(f)
    t = load_file(os.path.join(int6_engine, "rank0.safetensors"))
    heads = [n for n in ("embed_tokens", "lm_head") if n in cfg["quantization"]["layers"]]
    ref_dir = tmp_path / "e8"
    ref_dir.mkdir()
    for name in os.listdir(int6_engine):
        if name not in ("engine.json", "rank0.safetensors") and os.path.isfile(os.path.join(int6_engine, name)):
            (ref_dir / name).write_bytes(open(os.path.join(int6_engine, name), "rb").read())
    t8 = dict(t)
    for n in heads:
        t8[n + ".qweight"] = unpack_int6(t[n + ".qweight"])
        cfg["quantization"]["layers"][n]["method"] = "int8"
    save_file(t8, str(ref_dir / "rank0.safetensors"))
    (ref_dir / "engine.json").write_text(json.dumps(cfg))
    _, m6, _ = load_engine(int6_engine, "cpu")
    _, m8, _ = load_engine(str(ref_dir), "cpu")
    assert m6.embed_tokens.qweight.dtype == torch.uint8  # the stored codes, not widened
    ids = torch.tensor(IDS)
    assert torch.equal(m6.embed(ids), m8.embed(ids))
    emb = dequantize_int6(t["embed_tokens.qweight"], t["embed_tokens.scales"], 64)
    assert torch.equal(m6.embed(ids), emb[ids].to(torch.bfloat16))
    h = torch.randn(5, 128).to(torch.bfloat16)
    hn = heads[-1]
    head = dequantize_int6(t[hn + ".qweight"], t[hn + ".scales"], 64)
    ref = h.float() @ head.t()
    from simple_generate import prompt_logits
    y6 = m6.compute_logits(h)
    assert getattr(m6, hn)._get_packed().kind == "head6"
    _head_dot(m8, "int8")
    assert torch.equal(y6, m8.compute_logits(h))
    assert ((y6 - ref).norm() / ref.norm()).item() < 2e-2
    assert torch.equal(prompt_logits(m6, IDS), prompt_logits(m8, IDS))  # whole forward passes too
    monkeypatch.setenv("TRITIUM_HEAD_DOT", "0")
    _head_dot(m6, "none")
    _head_dot(m8, "none")
    y6w = m6.compute_logits(h)
    assert getattr(m6, hn)._get_packed().kind != "head6"
    assert torch.equal(y6w, m8.compute_logits(h))
    assert ((y6w - ref).norm() / ref.norm()).item() < 1e-2
    assert not torch.equal(y6w, y6)  # the two heads are different computations
    assert torch.equal(prompt_logits(m6, IDS), prompt_logits(m8, IDS))


@pytest.mark.parametrize("hidden, group", [(96, None), (128, 64)])
def test_int6_head_is_rounded_by_gptq_in_a_gptq_build(tiny_checkpoint, tmp_path, hidden, group):
    """Per row (96: 64 does not divide it) and in groups of 64 (128)."""
    src = tiny_checkpoint("llama", hidden_size=hidden, intermediate_size=96, num_attention_heads=4,
                          num_key_value_heads=2)
    out = str(tmp_path / "g6")
    # activation_quant none: the head is checked against its dequantized weights (weight-only numerics;
    # the default W4A8 also quantizes the head's activations)
    build_engine(BuildOptions(source=src, output=out, dtype="float32", quantization="int4-gptq",
                              embedding_quantization="int6", calibration_samples=8, progress=False,
                              eval_tokens=0, activation_quant="none"))
    cfg, model, _ = load_engine(out, "cpu")
    hn = "embed_tokens" if cfg.model.tie_word_embeddings else "lm_head"
    with open(os.path.join(out, "build_report.json")) as f:
        head = json.load(f)["quantization_report"]["layers"][hn]
    assert head["method"] == "int6" and head["head"] and "GPTQ" in head["rounding"]
    assert 0 < head["rel_output_error"] < 0.05
    t = load_file(os.path.join(out, "rank0.safetensors"))
    assert t[hn + ".scales"].shape == ((1000,) if group is None else (hidden // group, 1000))
    deq = dequantize_int6(t[hn + ".qweight"], t[hn + ".scales"], group)
    h = torch.randn(4, hidden)
    torch.testing.assert_close(model.compute_logits(h), h @ deq.t(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kw, match", [
    ({"quantization": "int4-rtn", "embedding_quantization": "int7"}, "--embedding-quantization 'int7' not supported"),
    ({"quantization": "none", "embedding_quantization": "int6"}, "--embedding-quantization int6 needs --quantization"),
])
def test_bad_embedding_quantization_values_are_refused(tiny_checkpoint, tmp_path, kw, match):
    src = tiny_checkpoint("llama", hidden_size=64, intermediate_size=96, num_attention_heads=4,
                          num_key_value_heads=2)
    with pytest.raises(ValueError, match=match):
        build_engine(BuildOptions(source=src, output=str(tmp_path / "x"), progress=False, eval_tokens=0, **kw))


def test_cli_refuses_a_bad_embedding_quantization_value(capsys):
    from tritium.client.cli.main import main
    with pytest.raises(SystemExit) as e:
        main(["build", "x", "-o", "y", "--quantization", "int4-rtn", "--embedding-quantization", "int5"])
    assert e.value.code == 2 and "--embedding-quantization" in capsys.readouterr().err


def test_tensor_parallel_shards_the_int6_embedding_by_vocabulary(tiny_checkpoint, int6_engine, tmp_path):
    """Each rank holds its vocabulary rows: packed codes row by row, the (K // G, N) scales by column."""
    src = tiny_checkpoint("llama", hidden_size=128, intermediate_size=96, num_attention_heads=4,
                          num_key_value_heads=2)
    out = str(tmp_path / "tp")
    build_engine(BuildOptions(source=src, output=out, dtype="bfloat16", quantization="int4-rtn",
                              group_size=32, tensor_parallel_size=2, progress=False, eval_tokens=0))
    assert_vocab_shards(int6_engine, out, lambda t: dequantize_int6(t["embed_tokens.qweight"], t["embed_tokens.scales"], 64))


@pytest.mark.parametrize("group", [None, 32])
def test_int6_clip_search_is_never_worse_than_the_amax_scale(group):
    """quantize_int6 picks each row's / group's scale among ratios of amax / 31 (1.0 included),
    each rounded to the stored 16-bit value: its squared error is at most that of amax / 31
    rounded the same way, row by row, and smaller in total on heavy-tailed rows."""
    from tritium.builder.quant.param16 import param16, param16_dtype
    from tritium.builder.quant.quantize_int8 import bf16_ceil, quantize_int6
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 128, generator=g) * torch.distributions.StudentT(2.0).sample((64, 128)).abs().clamp(max=30)
    q, s = quantize_int6(w, group)
    assert int(q.min()) >= -32 and int(q.max()) <= 31
    if group is None:
        assert s.dtype == torch.float32 and torch.equal(s.to(torch.bfloat16).float(), s)  # bfloat16 values
        full = s[:, None]
        wr = w
        s0 = bf16_ceil(w.abs().amax(1) / 31.0)[:, None]
    else:
        assert s.dtype == torch.float16 and s.shape == (128 // group, 64)
        full = s.float().t().repeat_interleave(group, dim=1)
        wr = w.view(64, -1, group)
        a0 = wr.abs().amax(2) / 31.0
        s0 = param16(a0, param16_dtype(a0), positive=True).float()[:, :, None]
    err = ((q.float() * full - w) ** 2).view(64, -1).sum(1)
    err0 = ((torch.round(wr / s0).clamp(-32, 31) * s0 - wr) ** 2).reshape(64, -1).sum(1)
    assert bool((err <= err0 * (1 + 1e-5)).all()) and float(err.sum()) < 0.99 * float(err0.sum())
