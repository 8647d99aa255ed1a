"""int4 on a block-quantized GGUF source: group sizes follow the source's blocks, RTN lands on
the source grid, GPTQ static groups / AWQ keep it; int4 builds store the embedding as int8.

Oracles: the `gguf` package's own quantize/dequantize (the tiny GGUF is written with it), the
int8 layout formula (w = q * scale per row) and plain torch matmuls.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader
from gguf import quants as gq
from safetensors.torch import load_file
from test_gguf_types import write_gguf

from tritium.backend.loader import load_engine
from tritium.builder.quant.awq import awq_search_scale
from tritium.builder.build import BuildOptions, build_engine
from tritium.builder.quant.gptq import HessianAccumulator, gptq_quantize
from tritium.builder.quant.quantize_int4 import int4_params_mse, quantize_int4
from tritium.kernels.quant_layouts import dequantize_int4
from tritium.builder.quant.quantize_int8 import dequantize_int8


@pytest.fixture(scope="module")
def tiny_gguf(tiny_checkpoint, tmp_path_factory):
    """GGUF with per-linear types: q F16, k Q8_0, v Q4_0, o Q4_1, gate Q8_0, up Q4_0, down BF16
    (test_gguf_types.TYPES); hidden 64, intermediate 96."""
    from transformers import AutoModelForCausalLM
    path = tiny_checkpoint("llama", hidden_size=64, intermediate_size=96, num_attention_heads=4,
                           num_key_value_heads=2,
                           rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = tmp_path_factory.mktemp("grid") / "m.gguf"
    write_gguf(hf, out)
    return str(out)


def _build(src, out, **kw):
    build_engine(BuildOptions(source=src, output=str(out), dtype="float32", progress=False, **kw))
    with open(os.path.join(out, "engine.json")) as f:
        return json.load(f)["quantization"]["layers"]


def _gguf_dequant(path, name):
    t = {t.name: t for t in GGUFReader(path).tensors}[name]
    return torch.from_numpy(np.array(gq.dequantize(t.data, t.tensor_type), dtype=np.float32))


def test_group_sizes_follow_source_blocks(tiny_gguf, tmp_path):
    layers = _build(tiny_gguf, tmp_path / "e", quantization="int4-rtn")
    # o: Q4_1 -> 32 (the default rule would give 64 for K = 64)
    assert layers["layers.0.o_proj"]["group_size"] == 32
    assert layers["layers.0.o_proj"]["group_reason"] == "source Q4_1 blocks of 32"
    # gate Q8_0 + up Q4_0: both blocks of 32, so the fused layer qualifies
    assert layers["layers.0.gate_up_proj"]["group_size"] == 32
    assert layers["layers.0.gate_up_proj"]["group_reason"] == "source Q4_0/Q8_0 blocks of 32"
    # q is F16: the fused qkv does not qualify and keeps the default rule
    assert layers["layers.0.qkv_proj"]["group_size"] == 64
    assert layers["layers.0.qkv_proj"]["group_reason"] == "default 128 does not divide 64 -> 64"
    # down is BF16 (K = 96): default rule
    assert layers["layers.0.down_proj"]["group_reason"] == "default 128 does not divide 96 -> 32"
    report = json.load(open(tmp_path / "e" / "build_report.json"))["quantization_report"]["layers"]
    assert report["layers.0.o_proj"]["group_reason"] == "source Q4_1 blocks of 32"


def test_rtn_reproduces_gguf_q4_1_grid(tiny_gguf, tmp_path):
    """The engine's int4 o_proj, dequantized, equals the gguf package's dequantized Q4_1 tensor
    (up to float16 storage of scale/zero; the default asymmetric layout); --group-size 64 is far
    off that grid."""
    _build(tiny_gguf, tmp_path / "e", quantization="int4-rtn")
    _build(tiny_gguf, tmp_path / "e64", quantization="int4-rtn", group_size=64)
    for i in range(2):
        ref = _gguf_dequant(tiny_gguf, f"blk.{i}.attn_output.weight")
        # pure function, float32 params: exact to float32 rounding
        deq32 = dequantize_int4(*quantize_int4(ref, 32), 32)
        assert (deq32 - ref).abs().max() <= 1e-5 * ref.abs().max()
        errs = {}
        for tag, g in (("e", 32), ("e64", 64)):
            t = load_file(str(tmp_path / tag / "rank0.safetensors"))
            p = f"layers.{i}.o_proj."
            deq = dequantize_int4(t[p + "qweight"], t[p + "scales"], t[p + "zeros"], g)
            errs[g] = ((deq - ref).norm() / ref.norm()).item()
        assert errs[32] < 1e-3 and errs[64] > 20 * errs[32]


def test_explicit_group_size_wins(tiny_gguf, tmp_path):
    layers = _build(tiny_gguf, tmp_path / "e", quantization="int4-rtn", group_size=64)
    assert layers["layers.0.o_proj"]["group_size"] == 64
    assert layers["layers.0.o_proj"]["group_reason"] == "--group-size 64"
    assert layers["layers.0.down_proj"]["group_reason"] == "--group-size 64 does not divide 96 -> 32"


@pytest.fixture(scope="module")
def hf_int4(tiny_checkpoint, tmp_path_factory):
    """Factory: int4-rtn engine of a tiny HF checkpoint with hidden = intermediate = 96."""
    cache = {}

    def make(family, **kw):
        key = (family, tuple(sorted(kw.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"int4-{family}") / "e"
            _build(tiny_checkpoint(family, hidden_size=96, intermediate_size=96), out,
                   quantization="int4-rtn", **kw)
            cache[key] = str(out)
        return cache[key]
    return make


def test_hf_source_keeps_default_rule(hf_int4):
    cfg = json.load(open(os.path.join(hf_int4("llama"), "engine.json")))
    lq = cfg["quantization"]["layers"]["layers.0.qkv_proj"]  # K = 96: 128, 64 do not divide
    assert lq["group_size"] == 32
    assert lq["group_reason"] == "default 128 does not divide 96 -> 32"


def _grid_weight(n=48, k=128, g=32, seed=0):
    """A weight on an asymmetric 4-bit grid per (row, block of g) spanning codes 0..15, as Q4_1."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k // g, g), generator=gen).float()
    q[..., 0], q[..., 1] = 0, 15
    d = torch.rand(n, k // g, 1, generator=gen) * 0.02 + 0.005
    m = -torch.rand(n, k // g, 1, generator=gen) * 0.1
    return (d * q + m).reshape(n, k)


def test_gptq_static_groups_keep_source_grid():
    w = _grid_weight()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(512, w.shape[1], generator=gen) * torch.linspace(0.2, 3, w.shape[1])
    acc = HessianAccumulator(w.shape[1])
    acc.add(x)
    q, s, z, g_idx = gptq_quantize(w, acc.hessian(), 32, act_order=True, static_groups=True)
    assert g_idx is None  # groups stay the contiguous source blocks
    deq = dequantize_int4(q, s, z, 32)
    assert (deq - w).abs().max() < 1e-5
    # static params are those of the original column blocks (the definition)
    s_ref, z_ref = int4_params_mse(w.reshape(w.shape[0], -1, 32))
    assert torch.allclose(s, s_ref.t()) and torch.allclose(z, z_ref.t())
    # dynamic act-order groups (g_idx) mix blocks and leave the grid
    q2, s2, z2, g2 = gptq_quantize(w, acc.hessian(), 32, act_order=True)
    assert ((dequantize_int4(q2, s2, z2, 32, g2) - w).abs().max() > 1e-3)


def test_gptq_static_groups_beat_rtn_off_grid():
    """Static groups still do GPTQ's error feedback: ||WX - QX|| below RTN on a random layer."""
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(64, 128, generator=gen)
    x = torch.randn(1024, 128, generator=gen) @ (torch.randn(128, 128, generator=gen) * 0.3 + torch.eye(128))
    acc = HessianAccumulator(128)
    acc.add(x)
    q, s, z, _ = gptq_quantize(w, acc.hessian(), 32, act_order=True, static_groups=True)
    rtn = dequantize_int4(*quantize_int4(w, 32), 32)
    err = lambda d: (x @ (d - w).t()).norm().item()  # noqa: E731
    assert err(dequantize_int4(q, s, z, 32)) < 0.9 * err(rtn)


def test_awq_search_includes_identity_and_keeps_grid():
    w = _grid_weight()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(256, w.shape[1], generator=gen) * torch.linspace(0.1, 5, w.shape[1])
    s, alpha, losses = awq_search_scale([w], x, x.abs().mean(0), 32)
    rtn = dequantize_int4(*quantize_int4(w, 32), 32)
    assert losses[0] == pytest.approx((x @ (rtn - w).t()).pow(2).mean().item(), abs=1e-9)
    assert alpha == 0.0 and torch.equal(s, torch.ones_like(s))


@pytest.mark.parametrize("family", ["qwen2", "llama"])  # tied / untied lm_head
def test_int8_embedding_lookup_and_logits(hf_int4, family):
    edir = hf_int4(family, embedding_quantization="int8")  # int4 builds: one scale per row
    cfg, model, _ = load_engine(edir, "cpu")
    t = load_file(os.path.join(edir, "rank0.safetensors"))
    assert t["embed_tokens.qweight"].dtype == torch.int8 and t["embed_tokens.scales"].shape == (cfg.model.vocab_size,)
    assert "embed_tokens.weight" not in t
    emb = dequantize_int8(t["embed_tokens.qweight"], t["embed_tokens.scales"])
    ids = torch.tensor([0, 7, 999, 7, 123])
    assert torch.equal(model.embed(ids), emb[ids])
    h = torch.randn(9, cfg.model.hidden_size)
    head = emb if cfg.model.tie_word_embeddings else dequantize_int8(t["lm_head.qweight"], t["lm_head.scales"])
    ref = h @ head.t()
    got = model.compute_logits(h)
    # packed int8 GEMM runs on bf16 activations (rel. rounding 2^-9 per element)
    assert ((got - ref).norm() / ref.norm()).item() < 1e-2
    assert cfg.quantization.layers["embed_tokens"].method == "int8"


def test_exclude_keeps_float_embedding(hf_int4):
    edir = hf_int4("qwen2", exclude_modules="embed_tokens")
    t = load_file(os.path.join(edir, "rank0.safetensors"))
    assert "embed_tokens.weight" in t and "embed_tokens.qweight" not in t
    cfg, model, _ = load_engine(edir, "cpu")
    assert cfg.quantization.layers["embed_tokens"].method == "none"
    assert torch.equal(model.embed(torch.tensor([3, 4])), t["embed_tokens.weight"][[3, 4]])


def test_older_engine_config_without_new_fields_loads(hf_int4):
    """Engines written before group_reason / static_groups / the int8 embedding still load."""
    from tritium.backend.config import EngineConfig
    d = json.load(open(os.path.join(hf_int4("llama"), "engine.json")))
    for lq in d["quantization"]["layers"].values():
        lq.pop("group_reason"), lq.pop("static_groups")
    del d["quantization"]["layers"]["embed_tokens"]
    cfg = EngineConfig.from_dict(d)
    assert cfg.quantization.layers["layers.0.qkv_proj"].group_reason is None
    from tritium.backend.models.decoder import DecoderLM
    assert DecoderLM(cfg).embed_tokens is None  # float embedding buffer, as before
