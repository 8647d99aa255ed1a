"""The tokenizer of a build source (calibration, SmoothQuant and the held-out evaluation)."""
from __future__ import annotations

import os
from typing import Optional


def load_source_tokenizer(source: Optional[str]):
    """tokenizers.Tokenizer of a build source (HF folder's tokenizer.json, or the GGUF's)."""
    from tokenizers import Tokenizer
    if source and os.path.isdir(source) and os.path.isfile(os.path.join(source, "tokenizer.json")):
        return Tokenizer.from_file(os.path.join(source, "tokenizer.json"))
    if source and os.path.isfile(source) and source.lower().endswith(".gguf"):
        import tempfile

        import gguf
        if "tokenizer.ggml.tokens" not in gguf.GGUFReader(source).fields:
            return None  # a GGUF without a vocabulary: token ids only, no eval / calibration
        from .tokenizer_export import export_gguf_tokenizer
        with tempfile.TemporaryDirectory() as d:
            export_gguf_tokenizer(source, d)
            return Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
    return None
