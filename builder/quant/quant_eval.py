"""Perplexity of an engine model on a token stream, and its divergence from a reference model.

Used by `tritium eval` and by every quantized build's report. Text is scored in consecutive,
non-overlapping windows of at most max_seq_len tokens (one window when it fits); inside a
window every token but the first is predicted from its prefix, as in a plain LM evaluation.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence

import torch

from tritium.kernels.attention_metadata import AttentionMetadata

KV_TORCH_DTYPES = {"int8": torch.int8, "fp8": getattr(torch, "float8_e4m3fn", None)}
LOGITS_CHUNK = 512  # rows of logits materialised at once (vocab-sized rows are large)


def kv_cache_dtype(model) -> torch.dtype:
    """Cache element dtype of an engine model: its quantized KV dtype or its float dtype."""
    kv = model.cfg.kv_cache.dtype
    return model.dtype if kv == "auto" else KV_TORCH_DTYPES[kv]


@torch.no_grad()
def window_log_probs(model, token_ids: Sequence[int]) -> torch.Tensor:
    """One prefill of `token_ids` through `model` (a DecoderLM); returns float32 log-probs
    (T - 1, vocab) of tokens 1..T-1 given their prefixes."""
    t = len(token_ids)
    bs = model.cfg.limits.block_size
    num_blocks = (t + bs - 1) // bs
    m = model.cfg.model
    device = model.norm_weight.device
    cdtype = kv_cache_dtype(model)
    kv = [(torch.zeros(num_blocks, bs, m.num_kv_heads, m.head_dim, dtype=cdtype, device=device),
           torch.zeros(num_blocks, bs, m.num_kv_heads, m.head_dim, dtype=cdtype, device=device))
          for _ in range(m.num_layers)]
    meta = AttentionMetadata.build([t], [t], [list(range(num_blocks))], bs, device=device)
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=device)
    hidden = model(ids, torch.arange(t, device=device), kv, meta)[:-1]
    return torch.cat([torch.log_softmax(model.compute_logits(hidden[i:i + LOGITS_CHUNK]), dim=-1)
                      for i in range(0, hidden.shape[0], LOGITS_CHUNK)])


def windows(token_ids: Sequence[int], max_window: int) -> List[List[int]]:
    """Consecutive windows of at most max_window tokens (windows of < 2 tokens are dropped)."""
    out = [list(token_ids[i:i + max_window]) for i in range(0, len(token_ids), max_window)]
    return [w for w in out if len(w) >= 2]


@torch.no_grad()
def evaluate(model, token_ids: Sequence[int], reference=None, progress: bool = False,
             reference_cache: Optional[dict] = None) -> dict:
    """Perplexity of `model` over token_ids; with a reference model also the mean
    KL(reference || model) of next-token distributions and their top-1 agreement.
    reference_cache (a dict, filled on first use) keeps the reference's log-probs per window, so
    scoring several models against one reference on the same tokens runs the reference once.

    Returns {"perplexity", "tokens", "nll", "windows"} (+ "reference_perplexity", "mean_kl",
    "top1_agreement" with a reference).
    """
    from tqdm import tqdm
    max_window = model.cfg.limits.max_seq_len
    if reference is not None:
        max_window = min(max_window, reference.cfg.limits.max_seq_len)
    wins = windows(token_ids, max_window)
    if not wins:
        raise ValueError("eval text too short: need at least 2 tokens")
    nll = ref_nll = kl = 0.0
    agree = scored = 0
    for i, w in enumerate(tqdm(wins, desc="evaluating", unit="window", disable=not progress)):
        target = torch.tensor(w[1:], dtype=torch.long)
        lp = window_log_probs(model, w)
        nll -= lp.gather(1, target[:, None].to(lp.device)).sum().item()
        if reference is not None:
            key = (i, tuple(w))
            if reference_cache is not None and key in reference_cache:
                rp = reference_cache[key].to(lp.device)
            else:
                rp = window_log_probs(reference, w).to(lp.device)
                if reference_cache is not None:
                    reference_cache[key] = rp
            ref_nll -= rp.gather(1, target[:, None].to(rp.device)).sum().item()
            kl += (rp.exp() * (rp - lp)).sum().item()
            agree += (rp.argmax(-1) == lp.argmax(-1)).sum().item()
        scored += len(w) - 1
    out = {"perplexity": math.exp(nll / scored), "tokens": scored, "nll": nll / scored, "windows": len(wins)}
    if reference is not None:
        out.update(reference_perplexity=math.exp(ref_nll / scored), mean_kl=kl / scored,
                   top1_agreement=agree / scored)
        out["perplexity_increase"] = out["perplexity"] / out["reference_perplexity"] - 1.0
    return out


def encode_text(tokenizer, text: str, num_tokens: Optional[int], add_bos: bool = False,
                bos_token_id: Optional[int] = None) -> List[int]:
    """Token ids of text without special tokens (a BOS in front with add_bos), cut to num_tokens."""
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    if add_bos:
        if bos_token_id is None:
            raise ValueError("--add-bos: the engine has no bos_token_id")
        ids = [bos_token_id] + ids
    return ids[:num_tokens] if num_tokens else ids
