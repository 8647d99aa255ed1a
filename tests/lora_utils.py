"""Test helpers for LoRA: random PEFT adapters (B randomized: PEFT initializes it to zero) on a
Hugging Face base, saved as PEFT writes them, and the engine's logits with an adapter."""
from __future__ import annotations

import torch

from simple_generate import prompt_logits


def make_peft_adapter(base, path: str, seed: int = 0, std: float = 0.2, **lora_kwargs):
    """Wrap `base` (an HF causal LM, modified in place by PEFT) with a random LoRA and save it
    (adapter_config.json + adapter_model.safetensors). Returns the PeftModel (eval mode)."""
    from peft import LoraConfig, get_peft_model
    lora_kwargs.setdefault("lora_dropout", 0.0)
    model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", **lora_kwargs))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    model.save_pretrained(path)
    return model.eval()


def hf_greedy(model, ids, n: int):
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                         attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


def engine_logits(engine, ids, lora_name=None):
    """float32 logits of every prompt position through the engine's model with an adapter."""
    if lora_name is None:
        return prompt_logits(engine.runner.model, ids)
    engine.lora.begin_single(engine.lora.resolve(lora_name), len(ids))
    try:
        return prompt_logits(engine.runner.model, ids)
    finally:
        engine.lora.end_step()


def rel_err(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()
