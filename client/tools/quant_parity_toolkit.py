"""The llm-compressor side of the quantization parity run (see client/tools/quant_parity.py).

Runs in a separate Python that has `llmcompressor` installed (it pins its own transformers and
numpy), so it imports nothing from Tritium and is invoked by file path:

    LLMC_PYTHON quant_parity_toolkit.py quantize --model BF16_DIR --windows windows.json \
        --method gptq|awq --scheme W4A16|W4A16_ASYM --group-size 128 --out DIR
    LLMC_PYTHON quant_parity_toolkit.py hf-eval --model QDIR --reference BF16_DIR \
        --text FILE --num-tokens 8192 --window 2048

`quantize` feeds llm-compressor's `oneshot` exactly the token windows in windows.json (the
windows Tritium's builder cuts from the same calibration text) and saves the model in
compressed-tensors format (pack-quantized for 4-bit integer weights), with the recipe and the
library versions in parity_recipe.json. `hf-eval` scores a model in HF transformers against a
reference the way `tritium eval` does: the first N tokens (no special tokens) in consecutive
windows, perplexity, mean KL(reference || model) and top-1 agreement, as JSON on stdout.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys


FALLBACK_GROUP_SIZES = (64, 32)  # Tritium's rule (builder/quant/quantize_int4.choose_group_size)


def layer_group_size(in_features: int, requested: int):
    """The requested group size if it divides in_features, else the largest of 64 / 32 below it
    that does (None if none): the group plan of `tritium build --group-size N`."""
    for g in (requested,) + tuple(f for f in FALLBACK_GROUP_SIZES if f < requested):
        if in_features % g == 0:
            return g
    return None


def group_plan(linears: dict, requested: int) -> dict:
    """{group size: [linear names]} for {name: in_features} (lm_head excluded by the caller)."""
    plan: dict = {}
    for name, k in sorted(linears.items()):
        g = layer_group_size(k, requested)
        if g is None:
            raise ValueError(f"--group-size {requested}: {name} has in_features {k}, fits no group size")
        plan.setdefault(g, []).append(name)
    return plan


def config_groups(plan: dict, symmetric: bool) -> dict:
    """compressed-tensors config_groups, one per group size. A linear is targeted by its name
    without the layer prefix (`re:.*mlp\\.down_proj$`) when every layer's linear of that name has
    the same group size, else by its full name."""
    suffix = {n: re.sub(r"^.*\.layers\.\d+\.", "", n) for names in plan.values() for n in names}
    sizes: dict = {}
    for g, names in plan.items():
        for n in names:
            sizes.setdefault(suffix[n], set()).add(g)
    groups = {}
    for g, names in sorted(plan.items(), reverse=True):
        targets = sorted({f"re:.*{re.escape(suffix[n])}$" if len(sizes[suffix[n]]) == 1
                          else f"re:^{re.escape(n)}$" for n in names})
        groups[f"group_{g}"] = {"targets": targets,
                                "weights": {"num_bits": 4, "type": "int", "strategy": "group",
                                            "group_size": g, "symmetric": symmetric, "dynamic": False}}
    return groups


def recipe_for(method: str, groups: dict, duo_scaling: bool = True) -> list:
    """llm-compressor modifiers for one parity row (4-bit weights, 16-bit activations; lm_head
    stays in float, as in llm-compressor's examples)."""
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier
    if method == "gptq":
        # GPTQModifier's defaults in 0.14: actorder "static", dampening_frac 0.01, block_size 128.
        return [GPTQModifier(config_groups=groups, ignore=["lm_head"])]
    if method == "awq":
        return [AWQModifier(duo_scaling=duo_scaling),
                QuantizationModifier(config_groups=groups, ignore=["lm_head"])]
    raise ValueError(f"--method {method!r}: allowed gptq, awq")


def _cpu_only_workarounds() -> None:
    """llm-compressor 0.14's AWQ pins its cached activations (IntermediatesCache.pin_memory) for
    faster host-to-device copies; pinning needs an accelerator and raises on a CPU-only torch.
    Without an accelerator there is no copy to speed up, so pinning becomes a no-op."""
    import torch
    from llmcompressor.pipelines.cache import IntermediatesCache
    if not torch.cuda.is_available():
        IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None


def cmd_quantize(a) -> None:
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.set_num_threads(a.threads)
    _cpu_only_workarounds()
    with open(a.windows) as f:
        windows = json.load(f)["windows"]
    lens = {len(w) for w in windows}
    if len(lens) != 1:
        raise ValueError(f"{a.windows}: windows of unequal length {sorted(lens)}")
    ds = Dataset.from_dict({"input_ids": windows, "attention_mask": [[1] * len(w) for w in windows]})
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype="auto")
    tok = AutoTokenizer.from_pretrained(a.model)
    linears = {n: m.in_features for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and not n.endswith("lm_head")}
    plan = group_plan(linears, a.group_size)
    recipe = recipe_for(a.method, config_groups(plan, a.scheme == "W4A16"),
                        duo_scaling=not a.no_duo_scaling)
    oneshot(model=model, tokenizer=tok, dataset=ds, recipe=recipe, max_seq_length=lens.pop(),
            num_calibration_samples=len(windows), shuffle_calibration_samples=False)
    model.save_pretrained(a.out, save_compressed=True)
    tok.save_pretrained(a.out)
    import compressed_tensors
    import llmcompressor
    import transformers
    info = {"method": a.method, "scheme": a.scheme, "group_size": a.group_size,
            "group_sizes": {str(g): len(n) for g, n in plan.items()},
            "samples": len(windows), "seq_len": len(windows[0]),
            "recipe": [repr(m) for m in recipe],
            "versions": {"llmcompressor": llmcompressor.__version__,
                         "compressed-tensors": compressed_tensors.__version__,
                         "transformers": transformers.__version__, "torch": torch.__version__}}
    with open(os.path.join(a.out, "parity_recipe.json"), "w") as f:
        json.dump(info, f, indent=1)
    print(json.dumps(info["versions"]))


LOGITS_CHUNK = 512  # rows of vocab-sized log-probs held at once (memory)


def _logits(model, ids) -> "torch.Tensor":
    import torch
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, :-1]


def cmd_hf_eval(a) -> None:
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(a.threads)
    tok = Tokenizer.from_file(os.path.join(a.reference, "tokenizer.json"))
    with open(a.text, encoding="utf-8", errors="replace") as f:
        ids = tok.encode(f.read(), add_special_tokens=False).ids[:a.num_tokens]
    dtype = getattr(torch, a.dtype)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype).eval()
    ref = AutoModelForCausalLM.from_pretrained(a.reference, dtype=dtype).eval()
    nll = ref_nll = kl = 0.0
    agree = scored = 0
    for i in range(0, len(ids), a.window):
        w = ids[i:i + a.window]
        if len(w) < 2:
            continue
        target = torch.tensor(w[1:])[:, None]
        lq, lr = _logits(model, w), _logits(ref, w)
        for j in range(0, len(w) - 1, LOGITS_CHUNK):
            lp = torch.log_softmax(lq[j:j + LOGITS_CHUNK].float(), dim=-1)
            rp = torch.log_softmax(lr[j:j + LOGITS_CHUNK].float(), dim=-1)
            t = target[j:j + LOGITS_CHUNK]
            nll -= lp.gather(1, t).sum().item()
            ref_nll -= rp.gather(1, t).sum().item()
            kl += (rp.exp() * (rp - lp)).sum().item()
            agree += (rp.argmax(-1) == lp.argmax(-1)).sum().item()
        del lq, lr
        scored += len(w) - 1
    ppl, ref_ppl = math.exp(nll / scored), math.exp(ref_nll / scored)
    print(json.dumps({"perplexity": ppl, "reference_perplexity": ref_ppl, "tokens": scored,
                      "perplexity_increase": ppl / ref_ppl - 1, "mean_kl": kl / scored,
                      "top1_agreement": agree / scored}))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="quant_parity_toolkit", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    q = sub.add_parser("quantize", help="llm-compressor oneshot on fixed token windows")
    q.add_argument("--model", required=True, help="float HF checkpoint folder")
    q.add_argument("--windows", required=True, help='JSON {"windows": [[token ids], ...]}')
    q.add_argument("--method", required=True, choices=("gptq", "awq"))
    q.add_argument("--scheme", default="W4A16", choices=("W4A16", "W4A16_ASYM"),
                   help="W4A16 symmetric or W4A16_ASYM (integer zero point)")
    q.add_argument("--group-size", type=int, default=128)
    q.add_argument("--no-duo-scaling", action="store_true", help="AWQ: scales from activations only")
    q.add_argument("--out", required=True, help="output folder (compressed-tensors checkpoint)")
    q.add_argument("--threads", type=int, default=1)
    e = sub.add_parser("hf-eval", help="perplexity / KL in HF transformers against a reference")
    e.add_argument("--model", required=True)
    e.add_argument("--reference", required=True, help="float checkpoint (its tokenizer.json is used)")
    e.add_argument("--text", required=True)
    e.add_argument("--num-tokens", type=int, default=8192)
    e.add_argument("--window", type=int, default=2048)
    e.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    e.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    {"quantize": cmd_quantize, "hf-eval": cmd_hf_eval}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
