"""GGUF import of every family, from files written by llama.cpp's own converter.

tests/gguf_oracle.py builds a tiny random Hugging Face checkpoint per family and runs
`convert_hf_to_gguf.py` from the llama-cpp-python sdist on it (float32 out). Oracles:
- config: the HF config.json the converter read (every key that changes the model) and the
  ModelConfig `model_config_from_hf` builds from it;
- weights: the checkpoint's safetensors, exactly (Gemma's norms as 1 + w, see gguf_names.py);
- tokenizer: the tokenizer the converter read (SmolLM2's tokenizer.json, or the SentencePiece
  model through the `sentencepiece` package), and the chat template;
- numerics: transformers on the original checkpoint, fp32 logits under teacher forcing and
  greedy tokens, against the engine built from the GGUF.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import gguf_oracle as oracle
from simple_generate import generate_simple, prompt_logits

FAMILIES = list(oracle.FAMILIES)
TEXTS = ["The quick brown fox 12345 jumps, Zürich café 東京 🙂", "def f(x):\n    return x ** 2  # two  spaces",
         "<|im_start|>user\nhi<|im_end|>"]
PROMPT = "Paged attention stores keys and values in blocks of 16 tokens."


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """family -> (HF checkpoint folder, GGUF file written by llama.cpp's converter)."""
    tmp = str(tmp_path_factory.mktemp("gguf-families"))
    out = {f: (oracle.make_checkpoint(f, os.path.join(tmp, f), tmp), os.path.join(tmp, f"{f}.gguf"))
           for f in FAMILIES}
    # one family also as f16 (what most published GGUFs hold before quantization)
    out["qwen3-f16"] = (out["qwen3"][0], os.path.join(tmp, "qwen3-f16.gguf"))
    oracle.convert_all([*out.values()][:-1] + [(*out["qwen3-f16"], "f16")])
    return out


@pytest.fixture(scope="module")
def checkpoints(converted):
    """family -> GGUFCheckpoint of its GGUF (opened once: parsing a 49k-token vocabulary takes seconds)."""
    from tritium.builder.gguf_loader import GGUFCheckpoint
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = GGUFCheckpoint(converted[family][1])
        return cache[family]
    return get


@pytest.fixture(scope="module")
def engines(converted, tmp_path_factory):
    """family -> float32 engine built from the GGUF (cached per module)."""
    from tritium.builder.build import BuildOptions, build_engine
    cache = {}

    def make(family):
        if family not in cache:
            out = str(tmp_path_factory.mktemp(f"gguf-engine-{family}") / "engine")
            # Phi-3's longrope uses its short factors while the sequence fits the original
            # context (64): an engine of that length serves exactly transformers' numbers.
            build_engine(BuildOptions(source=converted[family][1], output=out, dtype="float32",
                                      max_seq_len=64, progress=False))
            cache[family] = out
        return cache[family]
    return make


@pytest.mark.parametrize("family", FAMILIES)
def test_config_round_trips(family, converted, checkpoints):
    from tritium.builder.hf_loader import model_config_from_hf
    with open(os.path.join(converted[family][0], "config.json")) as f:
        want = json.load(f)
    ck = checkpoints(family)
    got = ck.hf_config
    assert got["model_type"] == want["model_type"]
    for key, value in want.items():
        if key not in oracle.IGNORED_KEYS:
            assert got.get(key, "<absent>") == value, (family, key)
    assert ck.model_config == model_config_from_hf(want)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_tensor_equals_the_checkpoint(family, converted, checkpoints):
    from safetensors.torch import load_file

    from tritium.builder.gguf_loader import hf_state_dict
    want = load_file(os.path.join(converted[family][0], "model.safetensors"))
    got = hf_state_dict(checkpoints(family))
    assert set(got) == set(want)
    for name, w in want.items():
        if family.startswith("gemma") and name.endswith("norm.weight"):
            # stored as w + 1; (w + 1) - 1 is exact for |w| <= 1, so 1 + w is bit-identical
            assert torch.equal(1 + got[name], 1 + w), name
            assert (got[name] - w).abs().max().item() <= 2 ** -23, name
        else:
            assert torch.equal(got[name], w), name


def test_f16_gguf_holds_the_checkpoint_rounded_to_f16(converted):
    """llama.cpp's f16 output keeps 1-D tensors (norms) in f32 and rounds the matrices to f16."""
    from safetensors.torch import load_file

    from tritium.builder.gguf_loader import GGUFCheckpoint, hf_state_dict
    hf_dir, gguf_path = converted["qwen3-f16"]
    ck = GGUFCheckpoint(gguf_path)
    assert {t.tensor_type.name for t in ck.reader.tensors} == {"F16", "F32"}
    want = load_file(os.path.join(hf_dir, "model.safetensors"))
    got = hf_state_dict(ck)
    assert set(got) == set(want)
    for name, w in want.items():
        assert torch.equal(got[name], w if w.dim() == 1 else w.half().float()), name


@pytest.mark.parametrize("family", FAMILIES)
def test_tokenizer_and_chat_template(family, converted, engines):
    from tokenizers import Tokenizer
    hf_dir, _ = converted[family]
    engine = engines(family)
    tok = Tokenizer.from_file(os.path.join(engine, "tokenizer.json"))
    if family in oracle.SPM_FAMILIES:
        import sentencepiece as spm
        sp = spm.SentencePieceProcessor(model_file=os.path.join(hf_dir, "tokenizer.model"))
        for text in TEXTS:
            assert tok.encode(text, add_special_tokens=False).ids == sp.encode(text), text
            assert tok.encode(text).ids[0] == sp.bos_id()  # a SentencePiece GGUF adds BOS (llama.cpp's default)
    else:
        ref = Tokenizer.from_file(os.path.join(hf_dir, "tokenizer.json"))
        for text in TEXTS:
            assert tok.encode(text).ids == ref.encode(text).ids, text
        # tokenizer.ggml.pre "smollm": llama.cpp splits digits one by one before GPT-2's regex
        with open(os.path.join(engine, "tokenizer.json")) as f:
            pre = json.load(f)["pre_tokenizer"]
        assert [p["type"] for p in pre["pretokenizers"]] == ["Digits", "ByteLevel"]
        assert pre["pretokenizers"][0]["individual_digits"] and pre["pretokenizers"][1]["use_regex"]
    with open(os.path.join(engine, "tokenizer_config.json")) as f:
        assert json.load(f)["chat_template"] == oracle.CHAT_TEMPLATE


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_from_gguf_matches_transformers(family, converted, engines):
    """fp32 logits under teacher forcing within 1e-4 (relative L2) and 16 greedy tokens equal to
    transformers' `generate` on the original checkpoint."""
    from transformers import AutoModelForCausalLM

    from tritium.backend.loader import load_engine
    ref_model = AutoModelForCausalLM.from_pretrained(converted[family][0], dtype=torch.float32).eval()
    cfg, model, tok = load_engine(engines(family), "cpu")
    ids = tok.encode(PROMPT).ids
    assert 6 < len(ids) <= 64 - 16  # longer than the sliding windows (6); fits Phi-3's 64
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0]
    ours = prompt_logits(model, ids)
    assert ((ours - ref).norm() / ref.norm()).item() < 1e-4
    want = ref_model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                              attention_mask=torch.ones(1, len(ids), dtype=torch.long))[0, len(ids):].tolist()
    got, _ = generate_simple(model, ids, 16)
    assert got == want


def _meta(overrides=None, arch="qwen3"):
    """A dict-backed metadata reader: a minimal valid `arch` file, with overrides."""
    base = {"general.architecture": arch, f"{arch}.embedding_length": 64, f"{arch}.block_count": 2,
            f"{arch}.attention.head_count": 4, f"{arch}.feed_forward_length": 88}
    base.update({k.replace("ARCH", arch): v for k, v in (overrides or {}).items()})
    return base.get


@pytest.mark.parametrize("overrides,tensors,needle", [
    ({"general.architecture": "bloom"}, {}, "general.architecture 'bloom' is not supported"),
    ({"ARCH.rope.scaling.type": "ntk"}, {}, "rope.scaling.type = 'ntk' is not supported"),
    ({"ARCH.attention.head_count": [4, 4]}, {}, "attention.head_count = [4, 4] (per-layer values)"),
    ({"ARCH.attention.value_length": 32}, {}, "attention.value_length = 32 is not supported"),
    ({}, {"rope_freqs.weight": [1.0, 0.5]}, "rope_freqs.weight (2 values) is not Llama 3 rope scaling"),
    ({}, {"rope_freqs.weight": [1.0] * 4 + [2.0] * 4}, "rope_freqs.weight (8 values) is not Llama 3"),
    ({"ARCH.rope.dimension_count": 8}, {}, "rope.dimension_count = 8 (partial rotary) is not supported"),
])
def test_unsupported_metadata_is_refused_naming_the_field(overrides, tensors, needle):
    from tritium.builder.convert import CheckpointError
    from tritium.builder.gguf_config import hf_config_from_gguf
    rows = {"token_embd.weight": 100, **{k: len(v) for k, v in tensors.items()}}
    with pytest.raises(CheckpointError) as e:
        hf_config_from_gguf(_meta(overrides), rows, tensors.__getitem__, "x.gguf")
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_mistral_window_on_every_layer():
    """GGUF arch `mistral` (older llama.cpp files): attention.sliding_window applies to all layers."""
    from tritium.builder.gguf_config import hf_config_from_gguf
    from tritium.builder.hf_loader import model_config_from_hf
    cfg = hf_config_from_gguf(_meta({"ARCH.attention.sliding_window": 7}, arch="mistral"),
                              {"token_embd.weight": 100}, None, "x.gguf")
    assert model_config_from_hf(cfg).sliding_windows == (7, 7)


def test_unknown_tokenizer_is_refused():
    from tritium.builder.tokenizer_export import check_gguf_tokenizer
    with pytest.raises(ValueError, match=r"tokenizer.ggml.model = 'bert' is not supported; allowed: gpt2"):
        check_gguf_tokenizer({"tokenizer.ggml.model": "bert"}.get, "x.gguf")
    with pytest.raises(ValueError, match=r"tokenizer.ggml.pre = 'mystery' .* not supported"):
        check_gguf_tokenizer({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "mystery"}.get, "x.gguf")
    for pre in ("qwen2", "refact", "olmo", "llama-bpe"):
        check_gguf_tokenizer({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre}.get, "x.gguf")


def test_cli_refuses_unknown_arch_and_stray_tensors_with_exit_2(tmp_path):
    import numpy as np
    from gguf import GGUFWriter
    cli = [sys.executable, "-m", "tritium.client.cli", "build"]
    for arch, extra, needle in [("falcon", None, "general.architecture 'falcon' is not supported"),
                                ("qwen3", "blk.0.attn_sub_norm.weight", "'blk.0.attn_sub_norm.weight' is not part")]:
        path = str(tmp_path / f"{arch}.gguf")
        w = GGUFWriter(path, arch)
        w.add_block_count(1)
        w.add_embedding_length(8)
        w.add_feed_forward_length(16)
        w.add_head_count(2)
        w.add_tensor("token_embd.weight", np.zeros((10, 8), np.float32))
        if extra:
            w.add_tensor(extra, np.zeros(8, np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        r = subprocess.run(cli + [path, "-o", str(tmp_path / f"e-{arch}")], capture_output=True, text=True)
        assert r.returncode == 2, r.stderr
        assert needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
