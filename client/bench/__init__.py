"""Benchmarks: serving, side by side with llama.cpp, speculative, tensor-parallel, quantized linears, kernels."""
