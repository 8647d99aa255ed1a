"""Import of compressed-tensors (llm-compressor format) checkpoints, against the library itself.

Each checkpoint is made by compressed-tensors 0.20 from a tiny random Llama (tests/prequant_ct.py):
the library's preset scheme, its calculate_qparams, its compressor and its config writer. The
oracle is the library's own decompression of the saved file, run in HF transformers.

Checks: (1) the engine's stored layout dequantizes (kernels/quant_layouts.py, the definition every
runtime path implements) to exactly the library's weights, bit for bit in float32; (2) logits of a
float32 engine against the library's decompressed model. fp8 runs in float32 on CPU: 1e-5
relative. int4 / int8 run through torch's packed CPU kernels, which take bfloat16 activations (and
bfloat16 scales): 2e-2 relative, the bf16 budget of test_engine_numerics, and we also require the
gap to be under a tenth (int8: 0.3) of the quantization error itself (library vs float model), so a wrong
code, scale or zero point mapping (which moves whole groups) cannot pass.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

# compressed-tensors (a test dependency, pinned in the `test` extra) is imported inside the helpers,
# not at collection: it imports triton.language, which must first be imported in interpreter mode
# by tests/kernel_env.py for the Triton kernel tests of the same session.
from prequant_ct import (ct_dequantized_state, ct_reference_model, engine_weight, float_source, make_ct_checkpoint,
                         rel_l2)
from simple_generate import prompt_logits

from tritium.backend.loader import load_engine
from tritium.builder.build import BuildOptions, build_engine

IDS = [5, 17, 923, 44, 300, 2, 81, 999, 13, 640, 7, 7, 7, 250, 18, 402, 77, 31, 500, 61, 3]
PARTS = {"qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o_proj": ("self_attn.o_proj",),
         "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"), "down_proj": ("mlp.down_proj",)}


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return float_source(str(tmp_path_factory.mktemp("float") / "llama"))




def _check_import(src, tmp_path, preset, kind, logits_tol, max_ratio=0.1, **kw):
    ck = make_ct_checkpoint(src, str(tmp_path / "ct"), preset, **kw)
    eng = str(tmp_path / "engine")
    cfg = build_engine(BuildOptions(source=ck, output=eng, dtype="float32", progress=False))
    assert cfg.quantization.method == "imported"
    assert cfg.quantization.imported["format"] == "compressed-tensors"
    assert cfg.activation_quant == "none"  # --activation-quant auto: an import stays weight-only
    from safetensors.torch import load_file
    tensors = load_file(os.path.join(eng, "rank0.safetensors"))
    lib = ct_dequantized_state(ck)
    for i in range(cfg.model.num_layers):
        for lin, parts in PARTS.items():
            name = f"layers.{i}.{lin}"
            assert cfg.quantization.layers[name].method == kind
            ours = engine_weight(tensors, cfg, name)
            theirs = torch.cat([lib[f"model.layers.{i}.{p}.weight"].float() for p in parts], 0)
            assert torch.equal(ours, theirs), (name, (ours - theirs).abs().max().item())
    ref = ct_reference_model(ck, src)
    from transformers import AutoModelForCausalLM
    flt = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    _, model, _ = load_engine(eng, "cpu")
    with torch.no_grad():
        r = ref(torch.tensor([IDS])).logits[0]
        f = flt(torch.tensor([IDS])).logits[0]
    o = prompt_logits(model, IDS)
    gap, quant_err = rel_l2(o, r), rel_l2(r, f)
    assert gap < logits_tol, (gap, quant_err)
    assert gap < max_ratio * quant_err, (gap, quant_err)
    return cfg, eng


@pytest.mark.parametrize("preset,kw", [("W4A16", {}), ("W4A16_ASYM", {"group_size": 32}),
                                       ("W4A16", {"strategy": "channel"}), ("W4A16_ASYM", {"group_size": 64}),
                                       ("W4A16_ASYM", {"fmt": "naive-quantized"})])
def test_pack_quantized_int4(src, tmp_path, preset, kw):
    cfg, _ = _check_import(src, tmp_path, preset, "int4", 2e-2, **kw)
    g = cfg.quantization.imported["groups"]["group_0"]
    assert g["symmetric"] == (preset == "W4A16")


@pytest.mark.parametrize("fmt", [None, "int-quantized"])   # None: the library's choice, pack-quantized
def test_int8_channel(src, tmp_path, fmt):
    # int8's own error is small (2e-2), the bf16 kernel's gap about a fifth of it: the exact
    # weight check above is the sharp one here
    _check_import(src, tmp_path, "W8A16", "int8", 2e-2, max_ratio=0.3, strategy="channel", fmt=fmt)


@pytest.mark.parametrize("preset", ["FP8", "FP8_DYNAMIC"])
def test_float_quantized_fp8_weight_only(src, tmp_path, preset):
    cfg, eng = _check_import(src, tmp_path, preset, "fp8", 1e-5)
    with open(os.path.join(eng, "build_report.json")) as f:
        report = json.load(f)
    assert report["quantization"] == "imported"
    assert "weight-only" in report["quantization_report"]["note"]
    assert "ignored" in cfg.quantization.imported["groups"]["group_0"]["activations"]


@pytest.mark.parametrize("fmt", [None, "int-quantized"])
def test_int8_group_wise(src, tmp_path, fmt):
    """The W8A16 preset's own group-wise scales (groups of 128 along the input) land on the grouped
    int8 layout as stored. The weights are checked bit for bit; the logits' gap (about 0.3 of the
    quantization error) is the CPU path's bfloat16 rounding of activations and dequantized weights."""
    cfg, _ = _check_import(src, tmp_path, "W8A16", "int8", 2e-2, max_ratio=0.5, fmt=fmt)
    lq = cfg.quantization.layers["layers.0.qkv_proj"]
    assert lq.group_size == cfg.quantization.imported["groups"]["group_0"]["group_size"] and not lq.asymmetric
    assert "int8 grouped" in cfg.quantization.layouts


def test_int8_group_size_that_is_not_a_multiple_of_32_is_refused(src, tmp_path):
    def edit(q):
        q["config_groups"]["group_0"]["weights"]["group_size"] = 48
    ck = make_ct_checkpoint(src, str(tmp_path / "ct"), "W8A16")
    with open(os.path.join(ck, "config.json")) as f:
        c = json.load(f)
    edit(c["quantization_config"])
    with open(os.path.join(ck, "config.json"), "w") as f:
        json.dump(c, f)
    with pytest.raises(ValueError, match=r"weights\.group_size = 48.*multiple of 32"):
        build_engine(BuildOptions(source=ck, output=str(tmp_path / "e"), progress=False))
    assert not os.path.exists(tmp_path / "e")


def test_quantization_flag_with_prequantized_source_is_refused(src, tmp_path):
    ck = make_ct_checkpoint(src, str(tmp_path / "ct"), "W4A16")
    for kw, flag in (({"quantization": "int4-rtn"}, "--quantization"), ({"kv_cache_dtype": "int8"}, "--kv-cache-dtype"),
                     ({"group_size": 64}, "--group-size")):
        with pytest.raises(ValueError, match=f"{flag}.*already quantized \\(compressed-tensors"):
            build_engine(BuildOptions(source=ck, output=str(tmp_path / "e"), progress=False, **kw))


@pytest.mark.parametrize("edit,field", [
    (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=3), r"weights \(type, num_bits\) = \('int', 3\)"),
    (lambda q: q.update(sparsity_config={"format": "sparse-24-bitmask"}), r"sparsity_config = .*supported: empty"),
    (lambda q: q.update(format="marlin-24") or q["config_groups"]["group_0"].update(format="marlin-24"),
     r"format = 'marlin-24'.*supported: pack-quantized, int-quantized, float-quantized, naive-quantized"),
    (lambda q: q.update(quant_method="bitsandbytes"), r"quant_method = 'bitsandbytes'.*supported: gptq, awq, compressed-tensors"),
    (lambda q: q["config_groups"]["group_0"].update(input_activations={"num_bits": 8, "type": "int", "dynamic": True}),
     r"input_activations = .*supported: null"),
])
def test_unsupported_variants_name_the_field(src, tmp_path, edit, field):
    ck = make_ct_checkpoint(src, str(tmp_path / "ct"), "W4A16")
    path = os.path.join(ck, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    edit(cfg["quantization_config"])
    with open(path, "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match=field):
        build_engine(BuildOptions(source=ck, output=str(tmp_path / "e"), progress=False))


def test_tensor_parallel_shards_dequantize_to_the_same_weights(src, tmp_path):
    ck = make_ct_checkpoint(src, str(tmp_path / "ct"), "W4A16_ASYM", group_size=32)
    one = str(tmp_path / "tp1")
    two = str(tmp_path / "tp2")
    build_engine(BuildOptions(source=ck, output=one, dtype="float32", progress=False))
    cfg = build_engine(BuildOptions(source=ck, output=two, dtype="float32", progress=False, tensor_parallel_size=2))
    from safetensors.torch import load_file
    full = load_file(os.path.join(one, "rank0.safetensors"))
    ranks = [load_file(os.path.join(two, f"rank{r}.safetensors")) for r in range(2)]
    for name, dim in (("layers.0.o_proj", 1), ("layers.1.down_proj", 1), ("layers.0.gate_up_proj", 0)):
        whole = engine_weight(full, cfg, name)
        parts = [engine_weight(t, cfg, name) for t in ranks]
        if name.endswith("gate_up_proj"):  # each rank holds [gate_r; up_r]
            half = [p.shape[0] // 2 for p in parts]
            glued = torch.cat([parts[0][:half[0]], parts[1][:half[1]], parts[0][half[0]:], parts[1][half[1]:]], 0)
        else:
            glued = torch.cat(parts, dim)
        assert torch.equal(glued, whole), name


def test_quantized_lm_head_is_refused(src, tmp_path):
    ck = make_ct_checkpoint(src, str(tmp_path / "ct"), "W4A16", ignore=())
    with pytest.raises(ValueError, match=r"lm_head is stored quantized.*not supported"):
        build_engine(BuildOptions(source=ck, output=str(tmp_path / "e"), progress=False))
