"""Load an engine directory: EngineConfig + weights + tokenizer, onto a device."""
from __future__ import annotations

import os
from typing import Optional, Tuple

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from .config import EngineConfig, EngineFormatError
from .models.decoder import DecoderLM
from .parallel_layout import local_config
from .quant import set_activation_quant


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_tokenizer(engine_dir: str):
    """tokenizers.Tokenizer from the engine's tokenizer.json, or None if the engine has none."""
    path = os.path.join(engine_dir, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    from tokenizers import Tokenizer
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises its own exception type
        raise EngineFormatError(f"{path}: cannot load tokenizer ({e})") from None


def load_engine(engine_dir: str, device: Optional[str] = None, rank: int = 0
                ) -> Tuple[EngineConfig, DecoderLM, object]:
    """Returns (cfg, model in eval mode on `device`, tokenizer or None). A tensor-parallel engine
    loads rank `rank`'s shard into a DecoderLM of that rank's size (parallel_layout.local_config);
    cfg is always the whole model's."""
    cfg = EngineConfig.load(engine_dir)
    if not 0 <= rank < cfg.tensor_parallel_size:
        raise EngineFormatError(f"rank {rank} is outside this engine's tensor_parallel_size "
                                f"{cfg.tensor_parallel_size}")
    dev = torch.device(device) if device else default_device()
    wpath = os.path.join(engine_dir, cfg.weights_file(rank))
    if not os.path.isfile(wpath):
        raise EngineFormatError(f"{wpath}: engine weights missing")
    try:
        tensors = load_file(wpath, device="cpu")
    except (SafetensorError, OSError, RuntimeError) as e:
        raise EngineFormatError(f"{wpath}: cannot read weights ({e}); truncated or corrupt?") from None
    model = DecoderLM(local_config(cfg, rank) if cfg.tensor_parallel_size > 1 else cfg)
    try:
        model.load_engine_weights(tensors)
    except ValueError as e:
        raise EngineFormatError(f"{wpath}: {e}") from None
    model = model.to(dev).eval()
    for layer in model.layers:
        for attr in ("k_scale", "v_scale", "k_offset", "v_offset"):
            if getattr(layer, attr) is not None:
                setattr(layer, attr, getattr(layer, attr).to(dev))
    set_activation_quant(model, cfg.activation_quant)
    # Quantized linears convert their stored layout to the device's kernel layout here
    # (e.g. torch's packed CPU int4 format), once, at load.
    for mod in model.modules():
        hook = getattr(mod, "prepare_for_device", None)
        if hook is not None:
            hook(dev)
    return cfg, model, load_tokenizer(engine_dir)
