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


def export_gguf_tokenizer(gguf_path: str, engine_dir: str) -> List[str]:
    """Write tokenizer.json / tokenizer_config.json (with chat template) from a GGUF file."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ValueError("building from GGUF needs the `transformers` package to convert the GGUF "
                         "tokenizer; pip install transformers") from None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tok = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(gguf_path)),
                                            gguf_file=os.path.basename(gguf_path))
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
