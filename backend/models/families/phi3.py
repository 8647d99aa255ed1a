"""Phi-3 / Phi-4 (phi3 architecture): Llama's layer with fused qkv_proj and gate_up_proj in the
checkpoint, LongRoPE ("su") scaling and an optional partial rotary factor."""
from .base import Family, llama_fields

PHI3 = Family("phi3", ("phi3",), hf_fields=llama_fields, fused_qkv=True, fused_gate_up=True, o_proj_bias=False)
