"""Every family of backend/models/families/ against Hugging Face transformers (the oracle) on tiny
random checkpoints (tests/tiny_models.py: odd head dims, windows shorter than the prompts,
layer-type patterns, tied and untied heads): fp32 logits under teacher forcing within 1e-4
relative (L2) error and greedy tokens equal to `generate`; a bf16 engine within the 3e-2 of
docs/architecture.md. Config translation details (Gemma defaults, old-style fields) are checked
against transformers' own config classes."""
from __future__ import annotations

import json
import math

import pytest
import torch

from tritium.backend.loader import load_engine
from tritium.builder.hf_loader import model_config_from_hf
from hf_oracle import PROMPTS, hf_model, rel_err
from simple_generate import generate_simple, prompt_logits

NEW_FAMILIES = ["qwen3", "gemma2", "gemma3", "phi3", "olmo2", "granite", "smollm3"]
# Phi-3's LongRoPE picks its short factors for sequences within original_max_position_embeddings
# (48 here): an engine whose max_seq_len fits them serves exactly transformers' numbers.
BUILD = {"phi3": {"max_seq_len": 48}}


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_fp32_logits_and_greedy_match_hf(family, tiny_checkpoint, tiny_engine):
    ref_model = hf_model(tiny_checkpoint(family))
    cfg, model, _ = load_engine(tiny_engine(family, "float32", **BUILD.get(family, {})), "cpu")
    assert cfg.model.architecture == family
    for ids in PROMPTS:
        with torch.no_grad():
            ref = ref_model(torch.tensor([ids])).logits[0]
        ours = prompt_logits(model, ids)
        assert ours.shape == ref.shape
        assert rel_err(ours, ref) < 1e-4, (family, ids, rel_err(ours, ref))
        want = ref_model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                                  attention_mask=torch.ones(1, len(ids), dtype=torch.long))[0, len(ids):].tolist()
        got, _ = generate_simple(model, ids, 24, eos_token_ids=cfg.model.eos_token_ids)
        assert got == want, (family, ids)


def test_phi3_long_factors_beyond_the_original_context(tiny_checkpoint, tiny_engine):
    """A 60-token prompt (> original_max_position_embeddings 48) in an engine of max_seq_len 192:
    transformers and the engine both rotate with the long factors and the attention factor."""
    ref_model = hf_model(tiny_checkpoint("phi3"))
    cfg, model, _ = load_engine(tiny_engine("phi3", "float32"), "cpu")
    assert cfg.limits.max_seq_len == 192 and cfg.model.rotary_dim == 12
    ids = [(i * 37 + 11) % 997 + 3 for i in range(60)]
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0]
    assert rel_err(prompt_logits(model, ids), ref) < 1e-4


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_bf16_within_stated_tolerance(family, tiny_checkpoint, tiny_engine):
    ref_model = hf_model(tiny_checkpoint(family))
    _, model, _ = load_engine(tiny_engine(family, "bfloat16", **BUILD.get(family, {})), "cpu")
    # 40 positions: random tiny models have many near-ties, so fewer make the 90% a coin toss
    ids = PROMPTS[0] + [(i * 37 + 11) % 997 + 3 for i in range(19)]
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0]
    ours = prompt_logits(model, ids)
    assert rel_err(ours, ref) < 3e-2, rel_err(ours, ref)
    agree = int((ours.argmax(-1) == ref.argmax(-1)).sum())
    assert agree >= math.ceil(0.9 * len(ids)), (family, agree, len(ids))


def _config(tiny_checkpoint, family) -> dict:
    with open(f"{tiny_checkpoint(family)}/config.json") as f:
        return json.load(f)


def test_family_fields_from_config(tiny_checkpoint):
    g3 = model_config_from_hf(_config(tiny_checkpoint, "gemma3"))
    # 5 local : 1 global, the local layers on their own rope base
    assert g3.sliding_windows == (6, 6, 6, 6, 6, None)
    assert g3.rope.theta == 1e6 and g3.rope_local.theta == 10000.0
    assert [g3.rope_kind(i) for i in range(6)] == ["local"] * 5 + ["global"]
    assert g3.qk_norm == "head" and g3.norm_placement == "sandwich" and g3.activation == "gelu_tanh"
    assert g3.attention_scale == pytest.approx(32 ** -0.5) and g3.embedding_multiplier == pytest.approx(8.0)
    g2 = model_config_from_hf(_config(tiny_checkpoint, "gemma2"))
    assert g2.sliding_windows == (5, None, 5, None) and g2.rope_local is None
    assert (g2.attn_logit_softcap, g2.final_logit_softcap) == (2.0, 3.0)
    assert model_config_from_hf(_config(tiny_checkpoint, "smollm3")).nope_layers == (1, 3)
    o2 = model_config_from_hf(_config(tiny_checkpoint, "olmo2"))
    assert (o2.norm_placement, o2.qk_norm) == ("post", "full")
    gr = model_config_from_hf(_config(tiny_checkpoint, "granite"))
    assert (gr.embedding_multiplier, gr.residual_multiplier, gr.attention_scale, gr.logits_scaling) == \
        (6.0, 0.4, 0.09, 2.5)
    assert gr.attention_bias and gr.o_proj_bias and gr.mlp_bias
    ph = model_config_from_hf(_config(tiny_checkpoint, "phi3"))
    assert ph.rope.scaling_type == "longrope" and ph.rope.factor == 4.0 and ph.rotary_dim == 12


def test_gemma3_old_style_config_and_default_layer_types(tiny_checkpoint):
    """A config.json without layer_types and with rope_theta / rope_local_base_freq (as older
    Gemma 3 files are written) means what transformers' Gemma3TextConfig makes of it."""
    from transformers import Gemma3TextConfig
    d = _config(tiny_checkpoint, "gemma3")
    for key in ("layer_types", "rope_parameters"):
        d.pop(key)
    d.update(num_hidden_layers=7, rope_theta=500000.0, rope_local_base_freq=20000.0, sliding_window_pattern=3,
             rope_scaling={"rope_type": "linear", "factor": 8.0})
    ours = model_config_from_hf(d)
    hf = Gemma3TextConfig(**{k: v for k, v in d.items() if k != "model_type"})
    assert [w is not None for w in ours.sliding_windows] == [t == "sliding_attention" for t in hf.layer_types]
    assert ours.sliding_windows == (6, 6, None, 6, 6, None, 6)
    assert ours.rope.theta == hf.rope_parameters["full_attention"]["rope_theta"] == 500000.0
    assert (ours.rope.scaling_type, ours.rope.factor) == ("linear", 8.0)
    assert hf.rope_parameters["full_attention"]["rope_type"] == "linear"
    assert ours.rope_local.scaling_type == hf.rope_parameters["sliding_attention"]["rope_type"] == "default"
    assert ours.rope_local.theta == hf.rope_parameters["sliding_attention"]["rope_theta"] == 20000.0


def test_qwen3_sliding_layers_above_max_window_layers(tiny_checkpoint, tmp_path):
    """Qwen3 with use_sliding_window: layers >= max_window_layers attend within a window (5 tokens
    here, under a 21-token prompt), the others fully."""
    from tritium.builder.build import BuildOptions, build_engine
    src = tiny_checkpoint("qwen3", use_sliding_window=True, sliding_window=5, max_window_layers=1)
    build_engine(BuildOptions(source=src, output=str(tmp_path / "e"), dtype="float32", progress=False))
    cfg, model, _ = load_engine(str(tmp_path / "e"), "cpu")
    assert cfg.model.sliding_windows == (None, 5)
    ref_model = hf_model(src)
    ids = PROMPTS[0]
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0]
    assert rel_err(prompt_logits(model, ids), ref) < 1e-4


def test_format_version_1_engine_loads_with_llama_defaults(tiny_engine, tmp_path):
    """An engine.json written before the family fields existed (format_version 1, none of them)
    loads with Llama's defaults and computes the same logits."""
    import shutil
    from tritium.backend.config import ModelConfig
    src = tiny_engine("qwen2", "float32")
    old = tmp_path / "old"
    shutil.copytree(src, old)
    cfg = json.loads((old / "engine.json").read_text())
    new_fields = ("activation", "norm_placement", "qk_norm", "o_proj_bias", "mlp_bias", "attention_scale",
                  "attn_logit_softcap", "final_logit_softcap", "embedding_multiplier", "residual_multiplier",
                  "logits_scaling", "rotary_dim", "rope_local", "nope_layers")
    assert set(new_fields) <= set(ModelConfig.__dataclass_fields__)
    for f in new_fields:
        cfg["model"].pop(f)
    for f in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate", "attention_factor",
              "short_factor", "long_factor"):
        cfg["model"]["rope"].pop(f)
    cfg["format_version"] = 1
    (old / "engine.json").write_text(json.dumps(cfg))
    _, a, _ = load_engine(src, "cpu")
    b_cfg, b, _ = load_engine(str(old), "cpu")
    assert b_cfg.format_version == 1 and b_cfg.model.norm_placement == "pre"
    torch.testing.assert_close(prompt_logits(b, PROMPTS[0]), prompt_logits(a, PROMPTS[0]), rtol=0, atol=0)
