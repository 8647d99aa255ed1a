"""Tiny random Hugging Face checkpoints for tests, built locally with save_pretrained.

Odd sizes on purpose (hidden 72, 3 KV heads, vocabulary 1000, head_dim != hidden/heads) so
that shape bugs cannot hide behind powers of two. Each checkpoint gets a byte-level BPE
tokenizer trained in-process on a few sentences (with multi-byte characters).
"""
from __future__ import annotations

import os

TRAIN_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Café, naïve, jalapeño, 東京, Zürich, ½ and emojis 🙂🚀 are multi-byte in UTF-8.",
    "In-flight batching mixes prefill and decode tokens in one step.",
] * 4

FAMILIES = {
    # Llama with GQA 6/3, head_dim 16 (q dim 96 != hidden 72), Llama-3 rope scaling, untied.
    "llama": dict(model_type="llama", hidden_size=72, intermediate_size=100, num_hidden_layers=3,
                  num_attention_heads=6, num_key_value_heads=3, head_dim=16, vocab_size=1000,
                  max_position_embeddings=256, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 64}),
    # Mistral with MQA and a sliding window shorter than the test prompts.
    "mistral": dict(model_type="mistral", hidden_size=72, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=1, head_dim=18, vocab_size=1000,
                    max_position_embeddings=256, sliding_window=7, tie_word_embeddings=False),
    # Qwen2 with MHA, q/k/v bias and tied embeddings.
    "qwen2": dict(model_type="qwen2", hidden_size=72, intermediate_size=88, num_hidden_layers=2,
                  num_attention_heads=3, num_key_value_heads=3, vocab_size=1000,
                  max_position_embeddings=256, tie_word_embeddings=True),
    # ---- the families of backend/models/families/ (tests/test_models_*.py) ----
    # Qwen3: per-head q/k norms, head_dim 24 (q dim 96 != hidden 64), GQA 4/2, untied.
    "qwen3": dict(model_type="qwen3", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=24, vocab_size=1000,
                  max_position_embeddings=256, tie_word_embeddings=False),
    # Gemma 2: sandwich norms, GELU-tanh, small soft-caps (so they bite on random weights),
    # alternating sliding (window 5 < the prompts) / global layers, query_pre_attn_scalar != head_dim, tied.
    "gemma2": dict(model_type="gemma2", hidden_size=64, intermediate_size=80, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=20, vocab_size=1000,
                   max_position_embeddings=256, sliding_window=5, query_pre_attn_scalar=24,
                   attn_logit_softcapping=2.0, final_logit_softcapping=3.0, tie_word_embeddings=True),
    # Gemma 3 (text): 5 local : 1 global (the default pattern over 6 layers), local rope base
    # 10000 vs global 1e6, q/k norms, window 6, MQA, odd head_dim 18, final soft-cap, untied head.
    "gemma3": dict(model_type="gemma3_text", hidden_size=64, intermediate_size=72, num_hidden_layers=6,
                   num_attention_heads=4, num_key_value_heads=1, head_dim=18, vocab_size=1000,
                   max_position_embeddings=256, sliding_window=6, query_pre_attn_scalar=32,
                   final_logit_softcapping=4.0, tie_word_embeddings=False),
    # Phi-3: fused qkv_proj / gate_up_proj, partial rotary 0.75 (12 of 16 channels), LongRoPE
    # with distinct short and long factors around original_max_position_embeddings 48.
    "phi3": dict(model_type="phi3", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                 max_position_embeddings=192, original_max_position_embeddings=48,
                 rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                  "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                                  "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0]},
                 tie_word_embeddings=False),
    # OLMo 2: post-norms only, q/k norms over the whole projections, GQA 4/2.
    "olmo2": dict(model_type="olmo2", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                  max_position_embeddings=256, tie_word_embeddings=False),
    # Granite: the four multipliers, attention (incl. o_proj) and MLP biases.
    "granite": dict(model_type="granite", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                    max_position_embeddings=256, embedding_multiplier=6.0, residual_multiplier=0.4,
                    attention_multiplier=0.09, logits_scaling=2.5, attention_bias=True, mlp_bias=True,
                    tie_word_embeddings=False),
    # SmolLM3: every 2nd layer without RoPE (no_rope_layers [1, 0, 1, 0]), tied.
    "smollm3": dict(model_type="smollm3", hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                    max_position_embeddings=256, no_rope_layer_interval=2, tie_word_embeddings=True),
}


def train_tokenizer(vocab_size: int = 1000):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TRAIN_TEXT, trainer)
    return tok


def make_checkpoint(family: str, path: str, seed: int = 0, init_std: float = 0.15, **overrides) -> str:
    """Save a random `family` model (config.json + safetensors + tokenizer) into `path`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast
    spec = dict(FAMILIES[family])
    spec.update(overrides)
    model_type = spec.pop("model_type")
    cfg = AutoConfig.for_model(model_type, initializer_range=init_std, bos_token_id=1, eos_token_id=2,
                               pad_token_id=0, **spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # non-trivial norm weights and biases, so their handling is tested
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tok = PreTrainedTokenizerFast(tokenizer_object=train_tokenizer(spec["vocab_size"]),
                                  bos_token="<s>", eos_token="</s>", unk_token="<|endoftext|>")
    tok.save_pretrained(path)
    return path
