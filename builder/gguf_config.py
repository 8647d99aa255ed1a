"""GGUF metadata -> a Hugging Face config.json dict for the same model.

A GGUF file describes its model with llama.cpp's keys (`qwen3.attention.head_count`, ...) plus
what llama.cpp's own loader assumes for each architecture (Gemma 2 slides every other layer,
SmolLM3 drops RoPE on every 4th layer, ...). This module writes both out as the keys
transformers' config.json has for that family, so `hf_loader.model_config_from_hf` builds the
engine's ModelConfig the same way for a GGUF file as for a safetensors folder.

Per-architecture facts come from llama.cpp's converter (`convert_hf_to_gguf.py`, what it writes)
and loader (`src/models/<arch>.cpp`, what it assumes when a key is absent).
"""
from __future__ import annotations

import math
from typing import Callable, Dict, Optional

from .convert import CheckpointError
from .gguf_meta import Meta
from .gguf_mla import deepseek_config
from .gguf_moe import moe_config
from .gguf_rope import rope_parameters

# GGUF general.architecture -> (HF model_type, HF architectures[0])
GGUF_ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("mistral", "MistralForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
    "olmo2": ("olmo2", "Olmo2ForCausalLM"),
    "granite": ("granite", "GraniteForCausalLM"),
    "smollm3": ("smollm3", "SmolLM3ForCausalLM"),
    # mixtures of experts (builder/gguf_moe.py); Mixtral is GGUF arch "llama" with an expert count
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "olmoe": ("olmoe", "OlmoeForCausalLM"),
    "gpt-oss": ("gpt_oss", "GptOssForCausalLM"),
    # DeepSeek-V2 / V2-Lite / V3 (builder/gguf_mla.py; V2 or V3 from its gating function)
    "deepseek2": ("deepseek_v3", "DeepseekV3ForCausalLM"),
}
# Tensors that carry configuration rather than weights (consumed here, never loaded as weights).
CONFIG_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
# llama.cpp's default sliding-window pattern per architecture (src/models/<arch>.cpp,
# load_swa_pattern(ml, n)): layer i slides when i % n < n - 1.
_SWA_PERIOD = {"gemma2": 2, "gemma3": 6, "olmo2": 4, "gpt-oss": 2}


def _layer_types(m: Meta, num_layers: int, period: int) -> list:
    """Per-layer "sliding_attention" / "full_attention" from attention.sliding_window_pattern
    (a bool per layer, or a period n) or llama.cpp's default period for the architecture."""
    pat = m.get("attention.sliding_window_pattern")
    if isinstance(pat, (list, tuple)):
        if len(pat) != num_layers:
            raise CheckpointError(f"{m.path}: metadata {m.arch}.attention.sliding_window_pattern has {len(pat)} "
                                  f"entries, block_count is {num_layers}")
        slide = [bool(x) for x in pat]
    else:
        n = int(pat) if pat is not None else period
        slide = [n > 1 and i % n < n - 1 for i in range(num_layers)]
    return ["sliding_attention" if s else "full_attention" for s in slide]


def hf_config_from_gguf(field: Callable[[str], object], tensor_rows: Dict[str, int],
                        read: Callable[[str], object], path: str) -> dict:
    """The Hugging Face config.json dict of the model a GGUF file holds.

    Args:
        field: metadata key -> value (None when absent).
        tensor_rows: GGUF tensor name -> its number of rows (the PyTorch dim 0).
        read: GGUF tensor name -> its values (for the small configuration tensors).
        path: the file, for error messages.
    Raises CheckpointError (one line naming the key and value) for what cannot be honoured.
    """
    arch = field("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise CheckpointError(f"{path}: general.architecture {arch!r} is not supported; supported: "
                              f"{', '.join(GGUF_ARCHITECTURES)}")
    m = Meta(field, arch, path)
    tensors = set(tensor_rows)
    model_type, hf_arch = GGUF_ARCHITECTURES[arch]
    hidden = m.req("embedding_length")
    heads = m.req("attention.head_count")
    layers = m.req("block_count")
    head_dim = m.get("attention.key_length", hidden // heads, int)
    if arch == "deepseek2":  # HF's head_dim there is the rope part (gguf_mla.py)
        head_dim = m.req("rope.dimension_count")
    v_dim = m.get("attention.value_length", head_dim, int)
    if v_dim != head_dim and arch != "deepseek2":  # deepseek2: the latent's MQA view (gguf_mla.py)
        raise CheckpointError(f"{path}: metadata {arch}.attention.value_length = {v_dim} is not supported; "
                              f"allowed: {head_dim} (attention.key_length)")
    if "token_embd.weight" not in tensor_rows:
        raise CheckpointError(f"{path}: tensor 'token_embd.weight' missing from the GGUF file")
    vocab = tensor_rows["token_embd.weight"]
    eos = field("tokenizer.ggml.eos_token_id")
    cfg = {
        "model_type": model_type, "architectures": [hf_arch],
        "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": m.req("feed_forward_length"),
        "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": m.get("attention.head_count_kv", heads, int), "head_dim": head_dim,
        "rms_norm_eps": m.get("attention.layer_norm_rms_epsilon", 1e-5, float),
        "max_position_embeddings": m.get("context_length", 2048, int),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors or "blk.0.attn_qkv.bias" in tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in tensors,
        "hidden_act": "silu",
        "bos_token_id": field("tokenizer.ggml.bos_token_id"),
        "eos_token_id": int(eos) if eos is not None else None,
        "pad_token_id": field("tokenizer.ggml.padding_token_id"),
    }
    rp = rope_parameters(m, tensors, read, head_dim)
    cfg["rope_parameters"] = rp
    cfg["rope_theta"] = rp["rope_theta"]
    if rp["rope_type"] != "default":
        cfg["rope_scaling"] = {k: v for k, v in rp.items() if k != "rope_theta"}
    if arch == "llama" and m.get("expert_count", 0, int):  # Mixtral (conversion/llama.py writes arch llama)
        cfg["model_type"], cfg["architectures"] = "mixtral", ["MixtralForCausalLM"]
        cfg["sliding_window"] = None
    _FAMILY[arch](m, cfg, tensors)
    if m.get("expert_count", 0, int) and arch != "deepseek2":
        moe_config(m, cfg, cfg["model_type"])
    if cfg.get("sliding_window") is None:
        # the spelling of "no windowed layers" transformers writes for Qwen3 / SmolLM3 / ...
        # (a window without layer_types stays one on every layer: Mistral, Phi-3)
        cfg.setdefault("layer_types", ["full_attention"] * layers)
    return cfg


def _sliding(m: Meta, cfg: dict, period: int, default_window: Optional[int] = None) -> None:
    window = m.get("attention.sliding_window", default_window, int)
    if not window:
        cfg["sliding_window"] = None
        return
    cfg["sliding_window"] = window
    cfg["layer_types"] = _layer_types(m, cfg["num_hidden_layers"], period)


def _llama(m, cfg, tensors):
    pass


def _mistral(m, cfg, tensors):
    cfg["sliding_window"] = m.get("attention.sliding_window", None, int) or None


def _qwen(m, cfg, tensors):
    # llama.cpp's converter writes no sliding window for Qwen2/3 (its runtime uses none).
    cfg["use_sliding_window"] = False
    cfg["sliding_window"] = None


def _gemma_common(m, cfg):
    cfg["hidden_act"] = cfg["hidden_activation"] = "gelu_pytorch_tanh"
    # llama.cpp (src/models/gemma2.cpp, gemma3.cpp): queries scale by 1/sqrt(head_dim), except
    # the 27B models (46 / 62 layers), which scale by 1/sqrt(hidden / heads).
    big = {"gemma2": 46, "gemma3": 62}[m.arch] == cfg["num_hidden_layers"]
    cfg["query_pre_attn_scalar"] = (cfg["hidden_size"] // cfg["num_attention_heads"]) if big else cfg["head_dim"]
    cfg["final_logit_softcapping"] = m.get("final_logit_softcapping", None, float)


def _gemma2(m, cfg, tensors):
    _gemma_common(m, cfg)
    cfg["attn_logit_softcapping"] = m.get("attn_logit_softcapping", None, float)
    _sliding(m, cfg, _SWA_PERIOD["gemma2"], default_window=4096)
    local = m.get("rope.freq_base_swa", None, float)
    if local is not None and local != cfg["rope_theta"]:
        raise CheckpointError(f"{m.path}: metadata gemma2.rope.freq_base_swa = {local} is not supported; "
                              f"allowed: {cfg['rope_theta']} (rope.freq_base)")


def _gemma3(m, cfg, tensors):
    _gemma_common(m, cfg)
    cfg["attn_logit_softcapping"] = None
    _sliding(m, cfg, _SWA_PERIOD["gemma3"])
    if cfg["sliding_window"] is None:
        cfg["layer_types"] = ["full_attention"] * cfg["num_hidden_layers"]
    # Local layers: their own base and never scaled (transformers' Gemma3 rope_parameters).
    local = m.get("rope.freq_base_swa", 10000.0, float)
    cfg["rope_local_base_freq"] = local
    cfg["rope_parameters"] = {"full_attention": cfg["rope_parameters"],
                              "sliding_attention": {"rope_type": "default", "rope_theta": local}}


def _phi3(m, cfg, tensors):
    rot = m.get("rope.dimension_count", cfg["head_dim"], int)
    cfg["partial_rotary_factor"] = cfg["rope_parameters"]["partial_rotary_factor"] = rot / cfg["head_dim"]
    # The converter writes 0 for "no sliding window" (Phi-4).
    cfg["sliding_window"] = m.get("attention.sliding_window", None, int) or None
    orig = m.get("rope.scaling.original_context_length", kind=int)
    cfg["original_max_position_embeddings"] = orig if orig is not None else cfg["max_position_embeddings"]
    rp = cfg["rope_parameters"]
    if rp["rope_type"] == "longrope":
        if len(rp["long_factor"]) * 2 != rot:
            raise CheckpointError(f"{m.path}: tensor rope_factors_long.weight has {len(rp['long_factor'])} values; "
                                  f"rope.dimension_count {rot} needs {rot // 2}")
        attn = m.get("rope.scaling.attn_factor", kind=float)
        scale = cfg["max_position_embeddings"] / cfg["original_max_position_embeddings"]
        default = math.sqrt(1 + math.log(scale) / math.log(cfg["original_max_position_embeddings"])) \
            if scale > 1.0 else 1.0
        if attn is not None and abs(attn - default) > 1e-6 * max(1.0, default):
            rp["attention_factor"] = cfg["rope_scaling"]["attention_factor"] = attn


def _olmo2(m, cfg, tensors):
    if m.get("attention.sliding_window", None, int):
        raise CheckpointError(f"{m.path}: metadata olmo2.attention.sliding_window = "
                              f"{m.get('attention.sliding_window')} (OLMo 3) is not supported; OLMo 2 has none")


def _granite(m, cfg, tensors):
    # llama.cpp's converter renames Granite's *_multiplier to *_scale (conversion/granite.py).
    cfg["embedding_multiplier"] = m.get("embedding_scale", 1.0, float)
    cfg["residual_multiplier"] = m.get("residual_scale", 1.0, float)
    cfg["attention_multiplier"] = m.get("attention.scale", 1.0 / math.sqrt(cfg["head_dim"]), float)
    cfg["logits_scaling"] = m.get("logit_scale", 1.0, float)


def _smollm3(m, cfg, tensors):
    # Not stored: llama.cpp (src/models/smollm3.cpp) drops RoPE on every 4th layer, as
    # transformers' default no_rope_layer_interval = 4 does.
    cfg["no_rope_layer_interval"] = 4
    cfg["no_rope_layers"] = [int((i + 1) % 4 != 0) for i in range(cfg["num_hidden_layers"])]
    cfg["use_sliding_window"] = False
    cfg["sliding_window"] = None


def _gpt_oss(m, cfg, tensors):
    _sliding(m, cfg, _SWA_PERIOD["gpt-oss"])
    if cfg["rope_parameters"]["rope_type"] == "yarn":  # see gguf_moe.py: not stored, not truncated
        cfg["rope_parameters"]["truncate"] = cfg["rope_scaling"]["truncate"] = False


_FAMILY = {"llama": _llama, "mistral": _mistral, "qwen2": _qwen, "qwen3": _qwen, "gemma2": _gemma2,
           "gemma3": _gemma3, "phi3": _phi3, "olmo2": _olmo2, "granite": _granite, "smollm3": _smollm3,
           "qwen3moe": _qwen, "olmoe": _llama, "gpt-oss": _gpt_oss,
           "deepseek2": deepseek_config}
