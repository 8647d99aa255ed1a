"""GGUF import of DeepSeek-V3 and DeepSeek-V2 (V2-Lite's layout), from files written by llama.cpp's
own converter (architecture `deepseek2`; builder/gguf_mla.py).

A tiny random checkpoint each (tests/gguf_oracle.py, MLA_FAMILIES: V3 with q_lora_rank, a dense
first layer, a shared expert, sigmoid group-limited routing with a random correction bias, and a
YaRN variant; V2-Lite without q_lora_rank, softmax greedy routing, two shared experts), converted
to float32 GGUF by `convert_hf_to_gguf.py` of the llama-cpp-python sdist, which splits kv_b_proj
per head into k_b (transposed) and v_b and writes the latent's MQA view as key/value_length.
Oracles: the config.json the converter read (every key that changes the model) and the
ModelConfig built from it; every tensor of the checkpoint's safetensors, exactly; transformers on
the original checkpoint, float32 logits within 1e-4 and 16 greedy tokens, against the engine built
from the GGUF. And what a deepseek2 file can say that the engine cannot honour is refused naming
the key.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import gguf_oracle as oracle
from simple_generate import generate_simple, prompt_logits

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = list(oracle.MLA_FAMILIES)
PROMPT = "Paged attention stores keys and values in blocks of 16 tokens."
# HF keys the converter does not carry over: training only, or the multi-token-prediction layers
# it drops (skip_mtp) and transformers' model never runs
SKIPPED_KEYS = {"output_router_logits", "num_nextn_predict_layers"}


def _random_correction_bias(path: str) -> None:
    """transformers saves e_score_correction_bias as zeros; a random one makes the routing choice
    differ from the scores (written into the checkpoint, so the converter and transformers read it)."""
    f = os.path.join(path, "model.safetensors")
    t = load_file(f)
    g = torch.Generator().manual_seed(3)
    for k in [k for k in t if k.endswith("e_score_correction_bias")]:
        t[k] = torch.randn(t[k].shape, generator=g) * 0.3
    save_file(t, f, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """family -> (HF checkpoint folder, GGUF file written by llama.cpp's converter)."""
    tmp = str(tmp_path_factory.mktemp("gguf-mla"))
    out = {f: (oracle.make_checkpoint(f, os.path.join(tmp, f), tmp), os.path.join(tmp, f"{f}.gguf"))
           for f in FAMILIES}
    for path, _ in out.values():
        _random_correction_bias(path)
    oracle.convert_all(list(out.values()))
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
    assert ck.field("general.architecture") == "deepseek2"
    got = ck.hf_config
    assert got["model_type"] == want["model_type"]
    for key, value in want.items():
        if key not in oracle.IGNORED_KEYS | SKIPPED_KEYS:
            assert got.get(key, "<absent>") == value, (family, key, got.get(key, "<absent>"))
    m = ck.model_config
    assert m == model_config_from_hf(want)
    assert (m.kv_lora_rank, m.num_experts, m.sparse(0), m.sparse(1)) == (40, 8, False, True)
    assert m.q_lora_rank == (want["q_lora_rank"] or 0)  # 0: V2-Lite's q_proj


@pytest.mark.parametrize("family", FAMILIES)
def test_every_tensor_equals_the_checkpoint(family, converted, checkpoints):
    from tritium.builder.gguf_loader import hf_state_dict
    ck = checkpoints(family)
    assert "blk.0.attn_k_b.weight" in ck.tensors and "blk.0.attn_kv_b.weight" not in ck.tensors  # the split form
    want = load_file(os.path.join(converted[family][0], "model.safetensors"))
    got = hf_state_dict(ck)
    assert set(got) == set(want)
    for name, w in want.items():
        assert torch.equal(got[name], w), name
    if family.startswith("deepseek_v3"):
        assert want["model.layers.1.mlp.gate.e_score_correction_bias"].abs().sum() > 0


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
    assert cfg.model.architecture == oracle.MLA_FAMILIES[family]["model_type"] and cfg.model.kv_lora_rank == 40
    ids = tok.encode(PROMPT).ids
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0]
    ours = prompt_logits(model, ids)
    assert ((ours - ref).norm() / ref.norm()).item() < 1e-4
    want = ref_model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                              attention_mask=torch.ones(1, len(ids), dtype=torch.long))[0, len(ids):].tolist()
    got, _ = generate_simple(model, ids, 16)
    assert got == want


@pytest.mark.parametrize("edit, key", [
    ({"deepseek2.expert_gating_func": 3}, "deepseek2.expert_gating_func = 3"),
    ({"deepseek2.expert_gating_func": 1}, "exp_probs_b.bias"),
])
def test_what_the_engine_cannot_honour_is_refused(edit, key, checkpoints):
    """The V3 file's metadata with one key changed: one CheckpointError naming it."""
    from tritium.builder.convert import CheckpointError
    from tritium.builder.gguf_config import hf_config_from_gguf
    ck = checkpoints("deepseek_v3")
    rows = {name: int(t.shape[1]) if len(t.shape) > 1 else int(t.shape[0]) for name, t in ck.tensors.items()}

    def field(k):
        return edit[k] if k in edit else ck.field(k)
    with pytest.raises(CheckpointError, match=key.replace(".", r"\.")):
        hf_config_from_gguf(field, rows, ck._read_raw, ck.path)


def test_softmax_groups_refused(checkpoints):
    """A V2 file (softmax) whose metadata names expert groups: refused naming expert_group_count."""
    from tritium.builder.convert import CheckpointError
    from tritium.builder.gguf_config import hf_config_from_gguf
    ck = checkpoints("deepseek_v2_lite")
    rows = {name: int(t.shape[1]) if len(t.shape) > 1 else int(t.shape[0]) for name, t in ck.tensors.items()}

    def field(k):
        return {"deepseek2.expert_group_count": 4}.get(k, ck.field(k))
    with pytest.raises(CheckpointError, match=r"deepseek2\.expert_group_count = 4"):
        hf_config_from_gguf(field, rows, ck._read_raw, ck.path)
