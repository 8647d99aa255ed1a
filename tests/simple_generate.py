"""A minimal single-sequence decode loop over the paged model: the reference the batched
runtime is checked against (test-only)."""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from tritium.kernels.attention_metadata import AttentionMetadata
from tritium.backend.models.decoder import DecoderLM


def alloc_kv_caches(model: DecoderLM, num_blocks: int, device=None) -> list:
    """One float (k_cache, v_cache) pair per layer, as the runner allocates them: (num_blocks,
    block_size, Hkv, D) each, or a latent cache under multi-head latent attention."""
    from tritium.backend.model_runner import alloc_kv_layer
    dev = device or model.norm_weight.device
    return [alloc_kv_layer(model.cfg, num_blocks, model.dtype, dev) for _ in range(model.cfg.model.num_layers)]


@torch.inference_mode()
def prompt_logits(model: DecoderLM, prompt_ids: Sequence[int]) -> torch.Tensor:
    """float32 logits (len(prompt), vocab) for every prompt position, in one prefill."""
    bs = model.cfg.limits.block_size
    n = len(prompt_ids)
    num_blocks = (n + bs - 1) // bs
    kv = alloc_kv_caches(model, num_blocks)
    dev = model.norm_weight.device
    meta = AttentionMetadata.build([n], [n], [list(range(num_blocks))], bs, dev)
    hidden = model(torch.tensor(list(prompt_ids), device=dev), torch.arange(n, device=dev), kv, meta)
    return model.compute_logits(hidden)


def sample_token(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                 generator: Optional[torch.Generator]) -> int:
    """Greedy when temperature == 0, else temperature + top-k + top-p (nucleus) sampling."""
    if temperature == 0:
        return int(torch.argmax(logits))
    logits = logits / temperature
    if top_k and top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, -1)
    if top_p < 1.0:
        sp, idx = torch.sort(probs, descending=True)
        keep = (sp.cumsum(-1) - sp) < top_p  # smallest prefix whose mass reaches top_p
        sp = sp * keep
        probs = torch.zeros_like(probs).scatter_(0, idx, sp)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))


@torch.inference_mode()
def generate_simple(model: DecoderLM, prompt_ids: List[int], max_tokens: int, temperature: float = 0.0,
                    top_k: int = 0, top_p: float = 1.0, seed: Optional[int] = None,
                    eos_token_ids: Sequence[int] = ()) -> Tuple[List[int], str]:
    """Returns (generated ids, finish_reason "stop" | "length")."""
    cfg = model.cfg
    bs = cfg.limits.block_size
    total = len(prompt_ids) + max_tokens
    num_blocks = (total + bs - 1) // bs
    kv = alloc_kv_caches(model, num_blocks)
    table = list(range(num_blocks))
    dev = model.norm_weight.device
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed if seed is not None else torch.seed())
    out: List[int] = []
    tokens = list(prompt_ids)
    new = list(prompt_ids)
    while len(out) < max_tokens:
        n = len(tokens)
        meta = AttentionMetadata.build([len(new)], [n], [table], bs, dev)
        hidden = model(torch.tensor(new, device=dev), torch.arange(n - len(new), n, device=dev), kv, meta)
        logits = model.compute_logits(hidden[-1:])[0].cpu()
        tok = sample_token(logits, temperature, top_k, top_p, gen)
        out.append(tok)
        if tok in eos_token_ids:
            return out, "stop"
        tokens.append(tok)
        new = [tok]
    return out, "length"
