"""GGUF import of the mixture-of-experts families, from files written by llama.cpp's own converter.

Mixtral, Qwen3-MoE, OLMoE and gpt-oss: a tiny random checkpoint each (tests/gguf_oracle.py,
MOE_FAMILIES), converted to float32 GGUF by `convert_hf_to_gguf.py` of the llama-cpp-python sdist
(experts stacked into ffn_{gate,up,down}_exps; gpt-oss's gate / up split and transposed).
Oracles: the config.json the converter read (every key that changes the model) and the
ModelConfig built from it; every tensor of the checkpoint's safetensors, exactly; transformers on
the original checkpoint, float32 logits within 1e-4 and 16 greedy tokens, against the engine built
from the GGUF. And an MXFP4 gpt-oss checkpoint through the converter: its MXFP4 experts read back
bit for bit, kept MXFP4 in the engine, logits against transformers on the dequantized checkpoint.
Qwen3-MoE is built without `mlp_only_layers`: the converter cannot map a dense layer among sparse
ones (docs/models.md).
"""
from __future__ import annotations

import json
import os

import pytest
import torch

import gguf_oracle as oracle
from simple_generate import generate_simple, prompt_logits

FAMILIES = list(oracle.MOE_FAMILIES)
PROMPT = "Paged attention stores keys and values in blocks of 16 tokens."
# HF keys the converter does not carry over and that only matter for training
TRAINING_KEYS = {"output_router_logits", "router_aux_loss_coef", "router_jitter_noise"}


def _mxfp4_checkpoint(src: str, dst: str) -> dict:
    """A copy of the gpt-oss checkpoint `src` with MXFP4 experts (random E2M1 codes and E8M0
    scales as `*_blocks` / `*_scales`); returns transformers' dequantization of each expert tensor
    (integrations/mxfp4.py), under its float HF name."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    shutil.copytree(src, dst)
    g = torch.Generator().manual_seed(3)
    tensors, want = {}, {}
    for k, t in load_file(os.path.join(dst, "model.safetensors")).items():
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            e, kk, n = t.shape
            blocks = torch.randint(0, 256, (e, n, kk // 32, 16), generator=g, dtype=torch.uint8)
            scales = torch.randint(120, 130, (e, n, kk // 32), generator=g, dtype=torch.uint8)
            tensors[k + "_blocks"], tensors[k + "_scales"] = blocks, scales
            want[k] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        else:
            tensors[k] = t
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    cfg = json.load(open(os.path.join(dst, "config.json")))
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    return want


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """family -> (HF checkpoint folder, GGUF file written by llama.cpp's converter); also
    "gpt_oss-mxfp4" -> (MXFP4 checkpoint, GGUF, the experts dequantized by transformers)."""
    tmp = str(tmp_path_factory.mktemp("gguf-moe"))
    out = {f: (oracle.make_checkpoint(f, os.path.join(tmp, f), tmp), os.path.join(tmp, f"{f}.gguf"))
           for f in FAMILIES}
    mx = os.path.join(tmp, "gpt_oss-mxfp4")
    want = _mxfp4_checkpoint(out["gpt_oss"][0], mx)
    oracle.convert_all(list(out.values()) + [(mx, mx + ".gguf")])
    out["gpt_oss-mxfp4"] = (mx, mx + ".gguf", want)
    return out


@pytest.fixture(scope="module")
def checkpoints(converted):
    from tritium.builder.gguf_loader import GGUFCheckpoint
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = GGUFCheckpoint(converted[family][1])
        return cache[family]
    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_config_round_trips(family, converted, checkpoints):
    from tritium.builder.hf_loader import model_config_from_hf
    with open(os.path.join(converted[family][0], "config.json")) as f:
        want = json.load(f)
    ck = checkpoints(family)
    got = ck.hf_config
    assert got["model_type"] == want["model_type"]
    for key, value in want.items():
        if key not in oracle.IGNORED_KEYS | TRAINING_KEYS:
            assert got.get(key, "<absent>") == value, (family, key, got.get(key, "<absent>"))
    assert ck.model_config == model_config_from_hf(want)
    assert ck.model_config.num_experts == want.get("num_local_experts", want.get("num_experts"))


@pytest.mark.parametrize("family", FAMILIES)
def test_every_tensor_equals_the_checkpoint(family, converted, checkpoints):
    from safetensors.torch import load_file

    from tritium.builder.gguf_loader import hf_state_dict
    want = load_file(os.path.join(converted[family][0], "model.safetensors"))
    got = hf_state_dict(checkpoints(family))
    assert set(got) == set(want)
    for name, w in want.items():
        assert torch.equal(got[name], w), name


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_from_gguf_matches_transformers(family, converted, tmp_path):
    """fp32 logits under teacher forcing within 1e-4 (relative L2) and 16 greedy tokens equal to
    transformers' `generate` on the original checkpoint."""
    from transformers import AutoModelForCausalLM

    from tritium.backend.loader import load_engine
    from tritium.builder.build import BuildOptions, build_engine
    out = str(tmp_path / "engine")
    build_engine(BuildOptions(source=converted[family][1], output=out, dtype="float32", max_seq_len=64,
                              progress=False))
    ref_model = AutoModelForCausalLM.from_pretrained(converted[family][0], dtype=torch.float32).eval()
    cfg, model, tok = load_engine(out, "cpu")
    assert cfg.model.architecture == family and cfg.model.num_experts > 0
    ids = tok.encode(PROMPT).ids
    assert 6 < len(ids) <= 64 - 16  # longer than gpt-oss's sliding window (6)
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0]
    ours = prompt_logits(model, ids)
    assert ((ours - ref).norm() / ref.norm()).item() < 1e-4
    want = ref_model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                              attention_mask=torch.ones(1, len(ids), dtype=torch.long))[0, len(ids):].tolist()
    got, _ = generate_simple(model, ids, 16)
    assert got == want


def test_gpt_oss_mxfp4_gguf_kept_as_stored(converted, tmp_path):
    """An MXFP4 gpt-oss checkpoint through the converter, which writes ggml MXFP4 blocks in its
    own nibble order: every tensor this import serves equals the checkpoint's, the MXFP4 blocks
    and scales bit for bit; the engine keeps the experts MXFP4, and its logits and greedy tokens
    equal transformers' on the checkpoint dequantized by transformers' MXFP4 integration."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from tritium.backend.loader import load_engine
    from tritium.builder.build import BuildOptions, build_engine
    from tritium.builder.gguf_loader import GGUFCheckpoint, hf_state_dict
    src, path, want = converted["gpt_oss-mxfp4"]
    ck = GGUFCheckpoint(path)
    assert {t.tensor_type.name for t in ck.reader.tensors if "_exps.weight" in t.name} == {"MXFP4"}
    stored = load_file(os.path.join(src, "model.safetensors"))
    got = hf_state_dict(ck)
    assert set(got) == set(stored)
    for name, w in stored.items():
        assert torch.equal(got[name], w), name
    out = str(tmp_path / "engine")
    build_engine(BuildOptions(source=path, output=out, dtype="float32", max_seq_len=64, progress=False))
    cfg, model, tok = load_engine(out, "cpu")
    assert cfg.quantization.layers["layers.0.experts.gate_up"].method == "mxfp4"
    deq = str(tmp_path / "deq")  # the float checkpoint holding transformers' dequantization
    shutil.copytree(converted["gpt_oss"][0], deq)
    save_file({**load_file(os.path.join(deq, "model.safetensors")), **want}, os.path.join(deq, "model.safetensors"),
              metadata={"format": "pt"})
    ref_model = AutoModelForCausalLM.from_pretrained(deq, dtype=torch.float32).eval()
    ids = tok.encode(PROMPT).ids
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0]
    assert ((prompt_logits(model, ids) - ref).norm() / ref.norm()).item() < 1e-4
    want_ids = ref_model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                                  attention_mask=torch.ones(1, len(ids), dtype=torch.long))[0, len(ids):].tolist()
    assert generate_simple(model, ids, 16)[0] == want_ids
