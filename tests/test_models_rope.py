"""Rotary variants (backend/models/rope.py) against transformers' ROPE_INIT_FUNCTIONS (the
oracle), through the config reader, so the fields a config.json carries are the ones used:
default, linear, dynamic NTK, llama3, YaRN (with mscale / beta / truncate / partial rotary),
LongRoPE (short and long factors, attention factor). Also the table: cos and sin scaled by the
attention factor as transformers' rotary embedding does."""
from __future__ import annotations

import pytest
import torch

from tritium.backend.models.rope import rope_parameters, rope_table
from tritium.builder.hf_loader import model_config_from_hf

HEAD_DIM, MAX_POS = 32, 256

VARIANTS = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn-mscale": {"rope_type": "yarn", "rope_theta": 20000.0, "factor": 8.0, "original_max_position_embeddings": 32,
                    "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2, "truncate": False},
    "yarn-partial": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "partial_rotary_factor": 0.5,
                     "original_max_position_embeddings": 64},
    "longrope": {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
                 "short_factor": [1.0 + 0.1 * i for i in range(16)], "long_factor": [1.0 + 0.7 * i for i in range(16)]},
}


def _hf_config(params: dict):
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=128, num_attention_heads=4, head_dim=HEAD_DIM, num_hidden_layers=1,
                       intermediate_size=64, vocab_size=64, max_position_embeddings=MAX_POS,
                       rope_parameters=dict(params))


def _hf_rope(hf_cfg, rope_type: str, seq_len):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    if rope_type == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(hf_cfg)
    return ROPE_INIT_FUNCTIONS[rope_type](hf_cfg, None, seq_len=seq_len)


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("seq_len", [48, 200, 600])
def test_inverse_frequencies_and_attention_factor_match_transformers(name, seq_len):
    params = VARIANTS[name]
    hf_cfg = _hf_config(params)
    d = hf_cfg.to_dict()
    d["model_type"] = "llama"
    m = model_config_from_hf(d)
    dim = m.rotary_dim or m.head_dim
    ours, ours_att = rope_parameters(m.rope, dim, m.max_position_embeddings, seq_len)
    ref, ref_att = _hf_rope(hf_cfg, params["rope_type"], seq_len)
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref.float(), rtol=1e-6, atol=0)
    assert ours_att == pytest.approx(float(ref_att), rel=1e-12)


def test_longrope_and_dynamic_depend_on_the_length_served():
    """The case split the engine relies on: short factors / the plain base while the engine's
    max_seq_len fits the original context, long factors / a larger base beyond."""
    for name in ("longrope", "dynamic"):
        d = _hf_config(VARIANTS[name]).to_dict()
        d["model_type"] = "llama"
        m = model_config_from_hf(d)
        short, _ = rope_parameters(m.rope, HEAD_DIM, MAX_POS, 64 if name == "longrope" else MAX_POS)
        long, _ = rope_parameters(m.rope, HEAD_DIM, MAX_POS, 65 if name == "longrope" else MAX_POS + 1)
        assert not torch.equal(short, long), name


def test_table_is_cos_sin_times_the_attention_factor():
    d = _hf_config(VARIANTS["yarn"]).to_dict()
    d["model_type"] = "llama"
    m = model_config_from_hf(d)
    inv, att = rope_parameters(m.rope, HEAD_DIM, MAX_POS, 100)
    assert att > 1.0
    t = rope_table(m.rope, HEAD_DIM, MAX_POS, 100)
    ang = torch.arange(100, dtype=torch.float32)[:, None] * inv[None, :]
    torch.testing.assert_close(t, torch.cat([ang.cos(), ang.sin()], -1) * att)
