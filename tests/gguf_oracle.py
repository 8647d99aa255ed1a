"""GGUF files written by llama.cpp's own converter, for the GGUF import tests.

Each family gets a tiny random Hugging Face checkpoint (transformers config class +
save_pretrained, float32) with a tokenizer the converter accepts, and
`vendor/llama.cpp/convert_hf_to_gguf.py` from the llama-cpp-python sdist (downloaded once into
the Tritium cache, as `tritium compare` does) turns it into a GGUF. The oracle writer is
therefore llama.cpp's, not this project's.

Tokenizers: byte-level BPE families get SmolLM2's tokenizer (the converter recognises its
pre-tokenizer; one trained here it refuses); Gemma 2 / 3 and Phi-3 get a SentencePiece
tokenizer.model trained here, as their converter paths want; so does Qwen2 (see FAMILIES).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
SMOLLM2_VOCAB = 49152
SPM_VOCAB = 384

_COMMON = dict(hidden_size=64, intermediate_size=88, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=256, rms_norm_eps=1e-6)
# What each checkpoint exercises: odd head dims, windows shorter than the test prompts,
# layer-type patterns, tied and untied heads, q/k norms, multipliers, NoPE layers, longrope.
FAMILIES = {
    # Llama 3 rope scaling (stored by the converter as rope_freqs.weight, three in-between values)
    "llama": dict(model_type="llama", num_hidden_layers=2, head_dim=16, tie_word_embeddings=False,
                  max_position_embeddings=2048,
                  rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 32.0,
                                   "original_max_position_embeddings": 1024}),
    # Qwen2 with q/k/v bias; given a SentencePiece tokenizer.model, which its converter path tries
    # first (with SmolLM2's, transformers would load it as Qwen2Tokenizer, whose split the converter
    # does not recognise).
    "qwen2": dict(model_type="qwen2", num_hidden_layers=2, tie_word_embeddings=True, rope_theta=1e6),
    "qwen3": dict(model_type="qwen3", num_hidden_layers=2, head_dim=24, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                   "original_max_position_embeddings": 64}),
    "olmo2": dict(model_type="olmo2", num_hidden_layers=2, tie_word_embeddings=False),
    "granite": dict(model_type="granite", num_hidden_layers=2, tie_word_embeddings=True,
                    embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0078125,
                    logits_scaling=8.0),
    "smollm3": dict(model_type="smollm3", num_hidden_layers=4, tie_word_embeddings=True),
    # llama.cpp keeps no query_pre_attn_scalar: it uses head_dim (non-27B), so the checkpoint does.
    "gemma2": dict(model_type="gemma2", num_hidden_layers=3, head_dim=24, query_pre_attn_scalar=24,
                   sliding_window=6, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                   tie_word_embeddings=True),
    "gemma3": dict(model_type="gemma3_text", num_hidden_layers=7, head_dim=24, query_pre_attn_scalar=24,
                   sliding_window=6, tie_word_embeddings=True,
                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    # Phi-3 long-context: longrope with short / long factors (head_dim 16 -> 8 factors each),
    # and a window on every layer (Phi-3-mini's 2047, here shorter than the prompt).
    "phi3": dict(model_type="phi3", num_hidden_layers=2, tie_word_embeddings=False, pad_token_id=0,
                 sliding_window=9, original_max_position_embeddings=64,
                 rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.2, 1.3, 1.5, 1.8, 2.2, 3.0],
                               "long_factor": [1.0, 1.3, 1.8, 2.5, 3.5, 5.0, 7.0, 9.0]}),
}
# Mixtures of experts (tests/test_gguf_moe.py). Qwen3-MoE without mlp_only_layers: the converter
# cannot map a dense layer among sparse ones. OLMoE's eps is its real 1e-5, which the converter
# writes whatever the checkpoint says. gpt-oss's layer types are its default (sliding on even
# layers), which llama.cpp assumes, and its SwiGLU limit llama.cpp's fixed 7.0.
MOE_FAMILIES = {
    "mixtral": dict(model_type="mixtral", num_hidden_layers=2, head_dim=16, tie_word_embeddings=False,
                    num_local_experts=6, num_experts_per_tok=2, intermediate_size=40),
    "qwen3_moe": dict(model_type="qwen3_moe", num_hidden_layers=2, head_dim=24, tie_word_embeddings=False,
                      moe_intermediate_size=32, num_experts=8, num_experts_per_tok=3, norm_topk_prob=True),
    "olmoe": dict(model_type="olmoe", num_hidden_layers=2, tie_word_embeddings=False, intermediate_size=32,
                  num_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-5),
    "gpt_oss": dict(model_type="gpt_oss", num_hidden_layers=3, head_dim=16, tie_word_embeddings=False,
                    intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=6,
                    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096}),
}
# DeepSeek (tests/test_gguf_mla.py; llama.cpp's arch deepseek2). V3: q_lora_rank, a dense first
# layer, a shared expert, sigmoid scores with a correction bias (made random by the test), top-3
# among the 2 best of 4 groups, scoring_func / topk_method as DeepSeek-V3's config.json spells them.
# Its YaRN variant has mscale == mscale_all_dim, which is all a GGUF can say (builder/gguf_mla.py).
# V2-Lite's layout: q_proj (no q_lora_rank), softmax greedy top-2, 2 shared experts.
_DS_V3 = dict(model_type="deepseek_v3", num_hidden_layers=3, num_key_value_heads=4, intermediate_size=96,
              moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
              first_k_dense_replace=1, n_shared_experts=1, kv_lora_rank=40, q_lora_rank=48, qk_rope_head_dim=8,
              qk_nope_head_dim=16, v_head_dim=32, routed_scaling_factor=2.5, tie_word_embeddings=False,
              scoring_func="sigmoid", topk_method="noaux_tc")
MLA_FAMILIES = {
    "deepseek_v3": _DS_V3,
    "deepseek_v3_yarn": dict(_DS_V3, rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                                          original_max_position_embeddings=64, beta_fast=32.0,
                                                          beta_slow=1.0, mscale=0.8, mscale_all_dim=0.8)),
    "deepseek_v2_lite": dict(model_type="deepseek_v2", num_hidden_layers=2, num_key_value_heads=4,
                             intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                             first_k_dense_replace=1, n_shared_experts=2, kv_lora_rank=40, q_lora_rank=None,
                             qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=32, routed_scaling_factor=1.5,
                             tie_word_embeddings=False),
}
SPM_FAMILIES = ("gemma2", "gemma3", "phi3", "qwen2")
# HF config.json keys that llama.cpp's converter does not carry over and that do not change the
# model's numerics (or that the GGUF side spells differently); the rest must round-trip.
IGNORED_KEYS = {"architectures", "dtype", "torch_dtype", "transformers_version", "initializer_range",
                "use_cache", "attention_dropout", "output_attentions", "output_hidden_states", "return_dict",
                "layer_norm_eps", "is_decoder", "pretraining_tp", "max_window_layers", "_sliding_window_pattern",
                "cache_implementation", "embd_pdrop", "resid_pdrop", "sliding_window_pattern",
                "use_bidirectional_attention"}


def converter_dir() -> str:
    """vendor/llama.cpp of the llama-cpp-python sdist (pip download once into the Tritium cache)."""
    from tritium.client.bench.llamacpp import llama_cpp_source
    return llama_cpp_source()


def smollm2_tokenizer_dir(tmp: str) -> str:
    """SmolLM2's tokenizer.json / tokenizer_config.json, exported from the SmolLM2 GGUF."""
    from tritium.builder.default_model import smollm2_gguf_path
    from tritium.builder.tokenizer_export import export_gguf_tokenizer
    out = os.path.join(tmp, "smollm2-tokenizer")
    if not os.path.isfile(os.path.join(out, "tokenizer.json")):
        os.makedirs(out, exist_ok=True)
        export_gguf_tokenizer(smollm2_gguf_path(), out)
    return out


def train_spm(path: str, family: str) -> None:
    """A tiny SentencePiece BPE tokenizer.model with byte fallback (Gemma: no dummy prefix)."""
    import io

    import sentencepiece as spm

    from tritium.builder.calibration import default_calibration_text
    lines = [ln for ln in default_calibration_text().splitlines() if ln.strip()][:400]
    ids = dict(pad_id=0, eos_id=1, bos_id=2, unk_id=3) if family.startswith("gemma") else \
        dict(unk_id=0, bos_id=1, eos_id=2, pad_id=-1)
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=buf, vocab_size=SPM_VOCAB,
                                   model_type="bpe", byte_fallback=True, character_coverage=1.0,
                                   normalization_rule_name="identity", remove_extra_whitespaces=False,
                                   add_dummy_prefix=not family.startswith("gemma"), split_digits=True,
                                   num_threads=1, minloglevel=2, **ids)
    with open(os.path.join(path, "tokenizer.model"), "wb") as f:
        f.write(buf.getvalue())


def make_checkpoint(family: str, path: str, tmp: str, seed: int = 0) -> str:
    """Save a random tiny `family` checkpoint with its tokenizer into `path`; returns path."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    os.makedirs(path, exist_ok=True)
    spec = {**_COMMON, **{**FAMILIES, **MOE_FAMILIES, **MLA_FAMILIES}[family]}
    model_type = spec.pop("model_type")
    spm_family = family in SPM_FAMILIES
    ids = dict(bos_token_id=2, eos_token_id=1, pad_token_id=0) if family.startswith("gemma") else \
        dict(bos_token_id=1, eos_token_id=2, pad_token_id=2)
    spec = {**ids, **spec}
    cfg = AutoConfig.for_model(model_type, vocab_size=SPM_VOCAB if spm_family else SMOLLM2_VOCAB, **spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    gemma = family.startswith("gemma")
    with torch.no_grad():  # every weight random, norms too (Gemma's around 0: its norm is 1 + w)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_((0.0 if gemma else 1.0) + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
            if name.endswith("experts.gate_up_proj"):
                p.mul_(6.0)  # gpt-oss: pre-activations beyond its SwiGLU limit (7), so the clamp bites
    model.save_pretrained(path)
    tok_cfg = {"chat_template": CHAT_TEMPLATE}
    if spm_family:
        train_spm(path, family)
        tok_cfg["tokenizer_class"] = "GemmaTokenizer" if gemma else "LlamaTokenizer"
    else:
        src = smollm2_tokenizer_dir(tmp)
        shutil.copy(os.path.join(src, "tokenizer.json"), path)
        with open(os.path.join(src, "tokenizer_config.json")) as f:
            # GPT2Tokenizer keeps SmolLM2's byte-level pre-tokenizer; transformers would otherwise
            # pick a class by model_type (Qwen2Tokenizer brings Qwen's own split regex).
            tok_cfg = {**json.load(f), **tok_cfg, "tokenizer_class": "GPT2Tokenizer"}
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(tok_cfg, f)
    return path


_DRIVER = """
import sys
src, args = sys.argv[1], sys.argv[2:]
sys.path.insert(0, src)
import convert_hf_to_gguf as c
for hf_dir, out, outtype in zip(args[0::3], args[1::3], args[2::3]):
    sys.argv = ["convert_hf_to_gguf.py", hf_dir, "--outfile", out, "--outtype", outtype]
    c.main()
"""


def convert_all(jobs) -> None:
    """llama.cpp's convert_hf_to_gguf.py on each (hf_dir, out_gguf[, outtype]) job (outtype
    default f32), in one child process (the converter's imports cost more than a tiny model)."""
    src = converter_dir()
    args = [x for job in jobs for x in (*job, "f32")[:3]]
    r = subprocess.run([sys.executable, "-c", _DRIVER, src, *args], capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    if r.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{r.stderr[-3000:]}")
