"""Granite (3.x): Llama's layer with four scalars: embeddings times embedding_multiplier, the
attention and MLP outputs times residual_multiplier, attention_multiplier as the softmax scale,
logits divided by logits_scaling."""
from .base import Family, llama_fields


def _granite_fields(cfg: dict) -> dict:
    return {**llama_fields(cfg),
            "embedding_multiplier": float(cfg.get("embedding_multiplier", 1.0)),
            "residual_multiplier": float(cfg.get("residual_multiplier", 1.0)),
            "attention_scale": float(cfg.get("attention_multiplier", 1.0)),
            "logits_scaling": float(cfg.get("logits_scaling", 1.0))}


GRANITE = Family("granite", ("granite",), hf_fields=_granite_fields)
