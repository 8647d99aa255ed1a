"""Load a GGUF file (llama.cpp format) through the `gguf` package.

Tensors are dequantized to float with gguf's reference dequantizers; llama.cpp's converter
stores Llama Q/K rows permuted for its interleaved RoPE, which is undone here so the weights
match Hugging Face's rotate_half layout.
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from tritium.backend.config import ModelConfig, RopeConfig

from .convert import CheckpointError

SUPPORTED_GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}
# Which architectures llama.cpp's converter permutes Q/K for.
PERMUTED_QK = ("llama", "mistral")

_LAYER_MAP = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp's permute: rows (head, 2, d/2) were stored as (head, d/2, 2)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class GGUFCheckpoint:
    """GGUF reader exposing the same get/has interface as HFCheckpoint (HF tensor names)."""

    def __init__(self, path: str):
        import gguf  # local import: only GGUF builds need it
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: GGUF file not found")
        try:
            self.reader = gguf.GGUFReader(path)
        except Exception as e:  # the gguf package raises assorted errors on bad files
            raise CheckpointError(f"{path}: cannot read GGUF ({type(e).__name__}: {e}); truncated or not GGUF?") from None
        self.path = path
        self._gguf = gguf
        arch = self.field("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise CheckpointError(f"{path}: general.architecture {arch!r} is not supported; supported: "
                                  f"{', '.join(GGUF_ARCHITECTURES)}")
        self.arch = arch
        self.tensors = {t.name: t for t in self.reader.tensors}
        for t in self.reader.tensors:
            if t.tensor_type.name not in SUPPORTED_GGUF_TYPES:
                raise CheckpointError(f"{path}: tensor {t.name!r} has type {t.tensor_type.name}, not supported; "
                                      f"supported: {', '.join(SUPPORTED_GGUF_TYPES)}")
        self.model_config = self._model_config()
        self._hf_to_gguf = self._name_map()

    def field(self, key: str, default=None):
        f = self.reader.fields.get(key)
        if f is None:
            return default
        return f.contents()

    def _req(self, key: str):
        v = self.field(key)
        if v is None:
            raise CheckpointError(f"{self.path}: required metadata {key!r} is missing")
        return v

    def _model_config(self) -> ModelConfig:
        a = self.arch
        hidden = int(self._req(f"{a}.embedding_length"))
        heads = int(self._req(f"{a}.attention.head_count"))
        kv_heads = int(self.field(f"{a}.attention.head_count_kv", heads))
        head_dim = int(self.field(f"{a}.attention.key_length", hidden // heads))
        layers = int(self._req(f"{a}.block_count"))
        vocab = self.field(f"{a}.vocab_size")
        if vocab is None:
            vocab = len(self._req("tokenizer.ggml.tokens"))
        sw = self.field(f"{a}.attention.sliding_window")
        windows = (int(sw),) * layers if (sw and a == "mistral") else ()
        eos = self.field("tokenizer.ggml.eos_token_id")
        return ModelConfig(
            architecture=GGUF_ARCHITECTURES[a], vocab_size=int(vocab), hidden_size=hidden,
            intermediate_size=int(self._req(f"{a}.feed_forward_length")), num_layers=layers,
            num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
            rms_norm_eps=float(self.field(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
            max_position_embeddings=int(self.field(f"{a}.context_length", 2048)),
            rope=RopeConfig(theta=float(self.field(f"{a}.rope.freq_base", 10000.0))),
            attention_bias=("blk.0.attn_q.bias" in self.tensors),
            tie_word_embeddings=("output.weight" not in self.tensors),
            sliding_windows=windows, bos_token_id=self.field("tokenizer.ggml.bos_token_id"),
            eos_token_ids=(int(eos),) if eos is not None else (),
            pad_token_id=self.field("tokenizer.ggml.padding_token_id"))

    def _name_map(self) -> Dict[str, str]:
        out = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
               "lm_head.weight": "output.weight"}
        for i in range(self.model_config.num_layers):
            for g, h in _LAYER_MAP.items():
                out[f"model.layers.{i}.{h}"] = f"blk.{i}.{g}"
        return out

    def has(self, name: str) -> bool:
        return self._hf_to_gguf.get(name) in self.tensors

    def get(self, name: str) -> torch.Tensor:
        gname = self._hf_to_gguf.get(name)
        if gname not in self.tensors:
            raise CheckpointError(f"{self.path}: tensor {gname or name!r} missing from the GGUF file")
        t = self.tensors[gname]
        try:
            data = self._gguf.quants.dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise CheckpointError(f"{self.path}: cannot decode tensor {gname!r} ({e}); truncated?") from None
        w = torch.from_numpy(np.array(data, dtype=np.float32, copy=True))
        m = self.model_config
        if self.arch in PERMUTED_QK and gname.endswith(("attn_q.weight", "attn_q.bias")):
            w = _unpermute(w, m.num_heads)
        elif self.arch in PERMUTED_QK and gname.endswith(("attn_k.weight", "attn_k.bias")):
            w = _unpermute(w, m.num_kv_heads)
        return w

    def block_quant(self, name: str) -> Optional[Tuple[str, int]]:
        """(GGUF type name, block size along the input dim) of HF tensor `name` when the file
        stores it block-quantized (Q4_0, Q4_1, Q8_0: blocks of 32); None for float or absent.
        ggml blocks run along ne0, the contiguous dim, which is a linear's input (K) dim."""
        t = self.tensors.get(self._hf_to_gguf.get(name))
        if t is None:
            return None
        block, _ = self._gguf.GGML_QUANT_SIZES[t.tensor_type]
        return (t.tensor_type.name, int(block)) if block > 1 else None

    def source_files(self) -> List[str]:
        return [self.path]

    def chat_template(self) -> Optional[str]:
        return self.field("tokenizer.chat_template")
