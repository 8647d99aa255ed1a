"""Llama (incl. Llama 3 RoPE scaling), Mistral (sliding window) and Qwen2 (q/k/v bias): pre-norm,
gated SiLU MLP, nothing else; the shared blocks as they are."""
from .base import Family, llama_fields

LLAMA = Family("llama", ("llama",), hf_fields=llama_fields)
MISTRAL = Family("mistral", ("mistral",), hf_fields=llama_fields, o_proj_bias=False)
QWEN2 = Family("qwen2", ("qwen2",), hf_fields=llama_fields, default_attention_bias=True, o_proj_bias=False)
