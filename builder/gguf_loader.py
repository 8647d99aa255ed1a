"""Load a GGUF file (llama.cpp format) through the `gguf` package.

The file's metadata becomes the Hugging Face config.json dict of the same model
(builder/gguf_config.py) and its tensors are served under HF names with llama.cpp's converter
edits undone (builder/gguf_names.py), so the engine is built by the same code as from a
safetensors folder. Tensors are dequantized to float with gguf's reference dequantizers.
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from .convert import CheckpointError
from .gguf_config import CONFIG_TENSORS, GGUF_ARCHITECTURES, hf_config_from_gguf
from .gguf_mla import mla_sources
from .gguf_moe import moe_sources
from .gguf_names import hf_to_gguf_names, undo_converter_edits

# MXFP4: gpt-oss's experts as llama.cpp's converter writes them from OpenAI's MXFP4 checkpoint
# (kept as stored, gguf_moe.py).
SUPPORTED_GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "MXFP4")
__all__ = ["GGUFFile", "GGUFCheckpoint", "GGUF_ARCHITECTURES", "SUPPORTED_GGUF_TYPES"]


class GGUFFile:
    """A GGUF file seen as a Hugging Face checkpoint: `hf_config` (the config.json dict) and
    get/has by HF tensor name."""

    def __init__(self, path: str):
        import gguf  # local import: only GGUF builds need it
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: GGUF file not found")
        try:
            self.reader = gguf.GGUFReader(path)
        except Exception as e:  # the gguf package raises assorted errors on bad files
            raise CheckpointError(f"{path}: cannot read GGUF ({type(e).__name__}: {e}); truncated or not GGUF?") from None
        self.path = path
        self._gguf = gguf
        self.tensors = {t.name: t for t in self.reader.tensors}
        for t in self.reader.tensors:
            if t.tensor_type.name not in SUPPORTED_GGUF_TYPES:
                raise CheckpointError(f"{path}: tensor {t.name!r} has type {t.tensor_type.name}, not supported; "
                                      f"supported: {', '.join(SUPPORTED_GGUF_TYPES)}")
        rows = {name: int(t.shape[1]) if len(t.shape) > 1 else int(t.shape[0]) for name, t in self.tensors.items()}
        self.hf_config = hf_config_from_gguf(self.field, rows, self._read_raw, path)
        self.arch = self.field("general.architecture")
        self._hf_to_gguf = hf_to_gguf_names(self.arch, self.hf_config["num_hidden_layers"])
        # MoE: HF expert / router names served from llama.cpp's stacked tensors (gguf_moe.py)
        n_exp = self.hf_config.get("num_local_experts") or self.hf_config.get("num_experts") or \
            self.hf_config.get("n_routed_experts") or 0
        mxfp4 = any(t.tensor_type.name == "MXFP4" for n, t in self.tensors.items() if "_exps." in n)
        if mxfp4 and self.hf_config["model_type"] == "gpt_oss":  # kept as stored (gguf_moe.py)
            self.hf_config["quantization_config"] = {"quant_method": "mxfp4"}
        self._moe = moe_sources(self.hf_config["model_type"], self.hf_config["num_hidden_layers"], n_exp,
                                "quantization_config" in self.hf_config) if n_exp else {}
        if self.arch == "deepseek2" and "blk.0.attn_kv_b.weight" not in self.tensors:  # k_b / v_b split (gguf_mla.py)
            self._moe.update(mla_sources(self.hf_config["num_hidden_layers"]))
        self._stacked: Dict[Tuple[str, bool], torch.Tensor] = {}  # the layer's stacked expert tensors, read once
        known = set(self._hf_to_gguf.values()) | set(CONFIG_TENSORS) | {g for gs, _, _ in self._moe.values() for g in gs}
        for name in self.tensors:
            if name not in known:
                raise CheckpointError(f"{path}: tensor {name!r} is not part of a {self.arch} model Tritium builds; "
                                      f"refusing rather than building a different model")

    def field(self, key: str, default=None):
        f = self.reader.fields.get(key)
        if f is None:
            return default
        return f.contents()

    def _read_raw(self, gname: str) -> np.ndarray:
        t = self.tensors[gname]
        try:
            data = self._gguf.quants.dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise CheckpointError(f"{self.path}: cannot decode tensor {gname!r} ({e}); truncated?") from None
        return np.array(data, dtype=np.float32, copy=True)

    def has(self, name: str) -> bool:
        if name in self._moe:
            return all(g in self.tensors for g in self._moe[name][0])
        return self._hf_to_gguf.get(name) in self.tensors

    def _read_stacked(self, gname: str, stored: bool) -> torch.Tensor:
        """A stacked expert tensor as float32 (or its stored bytes), kept while the converter walks
        its layer (each expert's matrix is a slice of it; dequantizing it once per expert would
        cost E times)."""
        key = (gname, stored)
        if key not in self._stacked:
            if gname not in self.tensors:
                raise CheckpointError(f"{self.path}: tensor {gname!r} missing from the GGUF file")
            layer = gname.split(".")[1]
            self._stacked = {k: v for k, v in self._stacked.items() if k[0].split(".")[1] == layer}
            self._stacked[key] = torch.from_numpy(np.array(self.tensors[gname].data, copy=True)) if stored else \
                torch.from_numpy(self._read_raw(gname))
        return self._stacked[key]

    def get(self, name: str) -> torch.Tensor:
        if name in self._moe:
            gnames, build, stored = self._moe[name]
            return build([self._read_stacked(g, stored) for g in gnames])
        gname = self._hf_to_gguf.get(name)
        if gname not in self.tensors:
            raise CheckpointError(f"{self.path}: tensor {gname or name!r} missing from the GGUF file")
        w = torch.from_numpy(self._read_raw(gname))
        c = self.hf_config
        return undo_converter_edits(self.arch, gname, w, c["num_attention_heads"], c["num_key_value_heads"])

    def hf_names(self) -> List[str]:
        """The HF names of every weight tensor the file holds."""
        return [hf for hf, g in self._hf_to_gguf.items() if g in self.tensors] + [n for n in self._moe if self.has(n)]

    def block_quant(self, name: str) -> Optional[Tuple[str, int]]:
        """(GGUF type name, block size along the input dim) of HF tensor `name` when the file
        stores it block-quantized (Q4_0, Q4_1, Q8_0: blocks of 32); None for float or absent.
        ggml blocks run along ne0, the contiguous dim, which is a linear's input (K) dim."""
        t = self.tensors.get(self._hf_to_gguf.get(name))
        if t is None or name in self._moe:  # experts are read as float (gguf_moe.py)
            return None
        block, _ = self._gguf.GGML_QUANT_SIZES[t.tensor_type]
        return (t.tensor_type.name, int(block)) if block > 1 else None

    def source_files(self) -> List[str]:
        return [self.path]

    def chat_template(self) -> Optional[str]:
        return self.field("tokenizer.chat_template")


class GGUFCheckpoint(GGUFFile):
    """GGUF reader with the same get/has/model_config interface as HFCheckpoint."""

    def __init__(self, path: str):
        super().__init__(path)
        from .hf_loader import model_config_from_hf
        self.model_config = model_config_from_hf(self.hf_config, f"{path} (GGUF metadata)")


def hf_state_dict(g: GGUFFile) -> Dict[str, torch.Tensor]:
    """Every weight of the file under its HF name (tests, small models)."""
    return {name: g.get(name) for name in g.hf_names()}
