"""Put tokenizer files into the engine directory.

HF folders: copy tokenizer.json and friends verbatim. GGUF: the tokenizer stored in the file
(vocab, merges, special tokens, chat template) is converted to tokenizer.json with Hugging
Face's own GGUF converter, so tokenization is exactly what transformers gives for that file.
"""
from __future__ import annotations

import json
import os
import shutil
import warnings
from typing import List


def copy_hf_tokenizer(files: List[str], engine_dir: str) -> List[str]:
    out = []
    for f in files:
        shutil.copy2(f, os.path.join(engine_dir, os.path.basename(f)))
        out.append(os.path.basename(f))
    return out


# tokenizer.ggml.model values that become a tokenizer.json (through transformers' GGUF converters).
SUPPORTED_GGUF_TOKENIZERS = {"gpt2": "byte-level BPE", "llama": "SentencePiece BPE"}
# tokenizer.ggml.pre values of byte-level BPE vocabularies whose split rule is GPT-2's regex
# (transformers' default for a "gpt2" vocabulary), or GPT-2's regex after splitting digits one
# by one (llama.cpp's llama-vocab.cpp: STARCODER, REFACT, COMMAND_R, SMOLLM, CODESHELL, EXAONE).
# Any other value must be one transformers maps to its own split regex, or the tokenizer would
# silently differ from the model's.
GPT2_SPLIT_PRES = ("default", "gpt-2", "gpt2", "phi-2", "mpt", "olmo")
DIGITS_GPT2_SPLIT_PRES = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone")


def check_gguf_tokenizer(field, path: str) -> None:
    """Refuse a GGUF tokenizer that cannot be reproduced exactly (one line naming the key)."""
    model = field("tokenizer.ggml.model")
    if model not in SUPPORTED_GGUF_TOKENIZERS:
        allowed = ", ".join(f"{k} ({v})" for k, v in SUPPORTED_GGUF_TOKENIZERS.items())
        raise ValueError(f"{path}: metadata tokenizer.ggml.model = {model!r} is not supported; allowed: {allowed}")
    if model == "gpt2":
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
        pre = field("tokenizer.ggml.pre") or "default"
        known = sorted(set(GPT2_SPLIT_PRES) | set(DIGITS_GPT2_SPLIT_PRES) | set(GGUF_PRE_TOKENIZER_SPLITS))
        if pre not in known:
            raise ValueError(f"{path}: metadata tokenizer.ggml.pre = {pre!r} (the byte-level BPE split rule) is not "
                             f"supported; allowed: {', '.join(known)}")


def export_gguf_tokenizer(gguf_path: str, engine_dir: str) -> List[str]:
    """Write tokenizer.json / tokenizer_config.json (with chat template) from a GGUF file.

    Works for every architecture (the converter is chosen by tokenizer.ggml.model and
    tokenizer.ggml.pre, with transformers' per-architecture SentencePiece variants for Gemma
    and Phi-3), not only for those whose config transformers itself can read from GGUF."""
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer
    except ImportError:
        raise ValueError("building from GGUF needs the `transformers` package (>= 5) to convert the GGUF "
                         "tokenizer; pip install -U transformers") from None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        arch, tok_dict, tok_config = get_gguf_tokenizer(gguf_path)
        check_gguf_tokenizer({"tokenizer.ggml.model": tok_dict.get("tokenizer_type"),
                              "tokenizer.ggml.pre": tok_dict.get("pre_tokenizer_type")}.get, gguf_path)
        backend, extra = convert_gguf_tokenizer(arch, tok_dict)
        if tok_dict.get("tokenizer_type") == "gpt2" and tok_dict.get("pre_tokenizer_type") in DIGITS_GPT2_SPLIT_PRES:
            from tokenizers import pre_tokenizers
            backend.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
        tok = PreTrainedTokenizerFast(tokenizer_object=backend, **{**tok_config, **extra})
        files = tok.save_pretrained(engine_dir)
    names = sorted({os.path.basename(f) for f in files if os.path.isfile(f)})
    _inline_chat_template(engine_dir)
    return names


def _inline_chat_template(engine_dir: str) -> None:
    """Keep the chat template inside tokenizer_config.json too, where older readers look."""
    tpl = os.path.join(engine_dir, "chat_template.jinja")
    cfgp = os.path.join(engine_dir, "tokenizer_config.json")
    if os.path.isfile(tpl) and os.path.isfile(cfgp):
        with open(cfgp) as f:
            cfg = json.load(f)
        if "chat_template" not in cfg:
            with open(tpl) as f:
                cfg["chat_template"] = f.read()
            with open(cfgp, "w") as f:
                json.dump(cfg, f, indent=2)
