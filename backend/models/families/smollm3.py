"""SmolLM3: Llama's layer where every no_rope_layer_interval-th layer has no RoPE (NoPE):
no_rope_layers[i] is 1 for a layer with RoPE, 0 for one without."""
from .base import Family, FamilyConfigError, llama_fields


def _smollm3_fields(cfg: dict) -> dict:
    n = int(cfg["num_hidden_layers"])
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = int(cfg.get("no_rope_layer_interval", 4))
        flags = [int((i + 1) % interval != 0) for i in range(n)]
    if len(flags) != n:
        raise FamilyConfigError(f"no_rope_layers has {len(flags)} entries; num_hidden_layers is {n}")
    return {**llama_fields(cfg), "nope_layers": tuple(i for i, f in enumerate(flags) if not f)}


SMOLLM3 = Family("smollm3", ("smollm3",), hf_fields=_smollm3_fields)
