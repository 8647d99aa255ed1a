"""Quantization: the methods (RTN, AWQ, GPTQ, FP8, KV scales) and the pipeline that plans and applies them."""
