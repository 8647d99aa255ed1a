"""GGUF loading of F32, F16, BF16, Q8_0, Q4_0 and Q4_1 tensors, and refusal of other types.

The oracle is transformers' Llama with each weight replaced by its GGUF round trip computed by
the `gguf` package's own quantize/dequantize (not ours); Q/K rows are written permuted the way
llama.cpp's converter does, so the loader's un-permute is exercised too.
"""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf import quants as gq

from tritium.backend.loader import load_engine
from simple_generate import prompt_logits
from tritium.builder.build import BuildOptions, build_engine

TYPES = {"self_attn.q_proj": Q.F16, "self_attn.k_proj": Q.Q8_0, "self_attn.v_proj": Q.Q4_0,
         "self_attn.o_proj": Q.Q4_1, "mlp.gate_proj": Q.Q8_0, "mlp.up_proj": Q.Q4_0, "mlp.down_proj": Q.BF16}
GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The row permutation llama.cpp's converter applies to Llama Q/K weights."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def roundtrip(w: np.ndarray, qtype) -> np.ndarray:
    if qtype == Q.F32:
        return w
    return gq.dequantize(gq.quantize(w, qtype), qtype)


def write_gguf(hf, path, override_type=None):
    c = hf.config
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_vocab_size(c.vocab_size)
    sd = {k: v.float().numpy() for k, v in hf.state_dict().items()}

    def add(name, arr, qtype):
        if qtype == Q.F32:
            w.add_tensor(name, arr.astype(np.float32))
        elif qtype in (Q.F16,):
            w.add_tensor(name, arr.astype(np.float16))
        else:
            w.add_tensor(name, gq.quantize(arr.astype(np.float32), qtype), raw_dtype=qtype)

    add("token_embd.weight", sd["model.embed_tokens.weight"], Q.Q8_0)
    add("output_norm.weight", sd["model.norm.weight"], Q.F32)
    add("output.weight", sd["lm_head.weight"], override_type or Q.Q4_1)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        add(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"], Q.F32)
        add(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"], Q.F32)
        for hf_name, qtype in TYPES.items():
            arr = sd[p + hf_name + ".weight"]
            if hf_name == "self_attn.q_proj":
                arr = llama_cpp_permute(arr, c.num_attention_heads)
            elif hf_name == "self_attn.k_proj":
                arr = llama_cpp_permute(arr, c.num_key_value_heads)
            add(f"blk.{i}.{GGUF_NAMES[hf_name]}.weight", arr, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture()
def hf_llama(tiny_checkpoint):
    from transformers import AutoModelForCausalLM
    # hidden and intermediate multiples of 32: GGUF's Q4/Q8 blocks hold 32 values
    path = tiny_checkpoint("llama", hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                           rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_gguf_types_match_hf_on_gguf_roundtripped_weights(hf_llama, tmp_path):
    write_gguf(hf_llama, tmp_path / "m.gguf")
    build_engine(BuildOptions(source=str(tmp_path / "m.gguf"), output=str(tmp_path / "e"), dtype="float32",
                              progress=False))
    with torch.no_grad():
        for name, p in hf_llama.named_parameters():
            qtype = Q.F32
            for key, t in TYPES.items():
                if key in name:
                    qtype = t
            if "embed_tokens" in name:
                qtype = Q.Q8_0
            if name == "lm_head.weight":
                qtype = Q.Q4_1
            if qtype == Q.BF16:
                new = torch.from_numpy(p.numpy()).to(torch.bfloat16).float()
            else:
                new = torch.from_numpy(roundtrip(p.numpy().astype(np.float32), qtype).copy())
            p.copy_(new.reshape(p.shape))
    ids = [5, 17, 923, 44, 300, 2, 81, 999, 13, 640]
    with torch.no_grad():
        ref = hf_llama(torch.tensor([ids])).logits[0]
    _, model, _ = load_engine(str(tmp_path / "e"), "cpu")
    ours = prompt_logits(model, ids)
    assert ((ours - ref).norm() / ref.norm()).item() < 1e-4


def test_unsupported_gguf_tensor_type_is_named(hf_llama, tmp_path):
    write_gguf(hf_llama, tmp_path / "bad.gguf", override_type=Q.Q5_0)
    r = subprocess.run([sys.executable, "-m", "tritium.client.cli", "build", str(tmp_path / "bad.gguf"), "-o",
                        str(tmp_path / "e")], capture_output=True, text=True)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "output.weight" in r.stderr and "Q5_0" in r.stderr and "Q4_1" in r.stderr


def test_truncated_gguf(hf_llama, tmp_path):
    write_gguf(hf_llama, tmp_path / "m.gguf")
    data = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "t.gguf").write_bytes(data[: len(data) // 3])
    r = subprocess.run([sys.executable, "-m", "tritium.client.cli", "build", str(tmp_path / "t.gguf"), "-o",
                        str(tmp_path / "e")], capture_output=True, text=True)
    assert r.returncode != 0 and "Traceback" not in r.stderr and "t.gguf" in r.stderr
