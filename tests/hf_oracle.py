"""The Hugging Face transformers oracle of the model-numerics tests: the reference model of a tiny
checkpoint, the prompts the parity tests feed both sides, and the error measure they compare by."""
from __future__ import annotations

import torch

# token-id prompts: a long one with repeats, a short one, a single token
PROMPTS = [[5, 17, 923, 44, 300, 2, 81, 999, 13, 640, 7, 7, 7, 250, 18, 402, 77, 31, 500, 61, 3],
           [1, 600, 601, 602],
           [999]]


def hf_model(path: str):
    """transformers' float32 model of the checkpoint folder, in eval mode."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float32."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()
