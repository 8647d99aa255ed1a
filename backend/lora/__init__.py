"""Multi-LoRA serving: PEFT adapters per request, mixed in one batch (docs/lora.md)."""
