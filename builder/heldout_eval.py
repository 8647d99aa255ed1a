"""The build report's held-out evaluation: a quantized model against its float model on every
held-out domain (calibration_mix.HELD_OUT_DOMAINS), text the calibration never saw."""
from __future__ import annotations

from .calibration_mix import HELD_OUT_DOMAINS, HELD_OUT_FILES, domain_text, file_sha256
from .quant.quant_eval import encode_text, evaluate

FIGURES = ("perplexity", "reference_perplexity", "perplexity_increase", "mean_kl", "top1_agreement",
           "tokens", "windows")


def evaluate_held_out(model, reference, tokenizer, num_tokens: int, progress: bool = False) -> dict:
    """Per held-out domain: perplexity, its increase over the reference, mean KL(reference ||
    model) and top-1 agreement over the first num_tokens tokens of the domain's shipped text.

    Returns {"held_out_domains": [...], "tokens_per_domain", "domains": {name: figures + text
    file and sha256}}, plus the first domain's figures at the top level (the report's former
    single-text layout, kept for readers of it) with "text" naming that domain."""
    domains = {}
    for d in HELD_OUT_DOMAINS:
        ids = encode_text(tokenizer, domain_text(d), num_tokens)
        res = evaluate(model, ids, reference=reference, progress=progress)
        domains[d] = {**{k: res[k] for k in FIGURES}, "file": HELD_OUT_FILES[d],
                      "sha256": file_sha256(HELD_OUT_FILES[d])}
    first = HELD_OUT_DOMAINS[0]
    return {**{k: domains[first][k] for k in FIGURES}, "text": f"held-out:{first}",
            "held_out_domains": list(HELD_OUT_DOMAINS), "tokens_per_domain": num_tokens, "domains": domains}
