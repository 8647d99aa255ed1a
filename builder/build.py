"""`tritium build`: checkpoint -> versioned engine directory.

load -> convert (fuse qkv / gate_up, check dims) -> [quantize] -> write engine.json,
rank0.safetensors, tokenizer files and build_report.json. The engine is written to a temporary
sibling folder and renamed into place, so a failed build never leaves a half-written engine.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import sys
import time
from dataclasses import dataclass
from typing import Dict, Optional, Union

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from tritium.backend.config import (BUILD_REPORT_FILE, SUPPORTED_DTYPES, EngineConfig, Limits,
                                    QuantConfig)

from .convert import CheckpointError, hf_to_engine_tensors
from .convert_mla import check_mla_build
from .convert_moe import check_moe_build
from tritium.backend.parallel_layout import plan_layout

from .output_dir import check_output_dir, new_build_dir, replace_dir
from .report import component_bytes, kv_cache_report, size_report, write_json
from .tp_shard import shard_engine_tensors

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TOOL_VERSION = "0.1.0"


@dataclass(frozen=True)
class BuildOptions:
    """Everything `tritium build` was asked to do."""
    source: str
    output: str
    dtype: str = "bfloat16"
    max_batch_size: int = 64
    max_seq_len: Optional[int] = None  # None: min(model context, 2048)
    block_size: int = 16
    allow_pickle: bool = False
    quantization: str = "none"
    group_size: Optional[int] = None
    kv_cache_dtype: str = "auto"
    kv_rotation: str = "auto"  # auto: hadamard for a quantized cache when head_dim is a power of two
    calibration_text: Optional[str] = None
    calibration_samples: Optional[int] = None  # None: the quantizer default (64 windows of 128 tokens)
    exclude_modules: Optional[str] = None
    embedding_quantization: Optional[str] = None  # None: auto (builder/quant/quant_plan.py)
    int4_layout: Optional[str] = None  # int4 builds: "asymmetric" (None: the default) or "symmetric" (quant_plan.py)
    tensor_parallel_size: int = 1  # rank{i}.safetensors for i < N (builder/tp_shard.py)
    deterministic: bool = False  # EngineConfig.deterministic: batch-invariant kernels only (docs/determinism.md)
    eval_tokens: Optional[int] = None  # quantized builds: eval-text tokens for the report (None: default, 0: skip)
    max_ppl_increase: Optional[float] = None  # --quantization auto: the budget in percent (builder/quant/quant_auto.py)
    auto_int4_method: Optional[str] = None     # --quantization auto: int4-rtn / int4-awq / int4-gptq
    auto_candidates: Optional[str] = None      # --quantization auto: e.g. "int4,int8,none"
    # EngineConfig.activation_quant ("int8": W8A8 / W4A8, SmoothQuant first); auto: int8 for int8 / int4
    # methods Tritium quantizes, else none (smoothquant.resolve_activation_quant)
    activation_quant: str = "auto"
    smoothquant: Optional[bool] = None  # False: --no-smoothquant; None: smoothquant.smoothquant_applies
    smoothquant_alpha: Optional[Union[float, str]] = None  # None: smoothquant.DEFAULT_ALPHA ("auto")
    progress: bool = True

    def validate(self) -> None:
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"--dtype {self.dtype!r} not supported; allowed: {', '.join(SUPPORTED_DTYPES)}")
        for name in ("max_batch_size", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if self.max_seq_len is not None and self.max_seq_len <= 0:
            raise ValueError(f"--max-seq-len must be > 0, got {self.max_seq_len}")
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"--tensor-parallel-size must be an integer >= 1, got {tp!r}")
        emb = self.embedding_quantization
        if emb is not None and emb != "auto" and self.quantization in ("none", "auto"):
            raise ValueError(f"--embedding-quantization {emb} needs --quantization int8, fp8, int4-rtn, int4-awq "
                             f"or int4-gptq" + (" (--quantization auto picks the embedding's format itself)"
                                                if self.quantization == "auto" else ""))
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"--block-size must be a power of two (e.g. 16 or 32), got {self.block_size}")


def open_checkpoint(source: str, allow_pickle: bool):
    """Return an HFCheckpoint or GGUFCheckpoint for `source` (folder or .gguf file)."""
    if os.path.isfile(source) and source.lower().endswith(".gguf"):
        from .gguf_loader import GGUFCheckpoint
        return GGUFCheckpoint(source)
    if os.path.isdir(source):
        from .hf_loader import HFCheckpoint
        return HFCheckpoint(source, allow_pickle=allow_pickle)
    if os.path.isfile(source) and source.lower().endswith((".bin", ".pt", ".pth")):
        raise CheckpointError(f"{source}: pickled checkpoints are refused (unpickling runs code); pass the "
                              f"checkpoint folder with --allow-pickle if you trust it")
    raise CheckpointError(f"{source}: not found (expected a Hugging Face checkpoint folder or a .gguf file)")


def sha256_files(paths, progress: bool) -> str:
    h = hashlib.sha256()
    total = sum(os.path.getsize(p) for p in paths)
    with tqdm(total=total, unit="B", unit_scale=True, desc="hashing source", disable=not progress) as bar:
        for p in paths:
            with open(p, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 22), b""):
                    h.update(chunk)
                    bar.update(len(chunk))
    return h.hexdigest()


def build_engine(opts: BuildOptions) -> EngineConfig:
    """Build an engine per `opts`; returns the EngineConfig written to opts.output."""
    opts.validate()
    out = check_output_dir(opts.output, opts.source)  # before any work: never overwrite a stranger's folder
    t0 = time.time()
    # Quantization contract (builder/quant/quant_pipeline.py): validate_quant_args(opts) raises ValueError
    # before any work; quantize_engine_weights(cfg, tensors, opts) -> (tensors, QuantConfig,
    # KVCacheConfig, report dict). `opts` is this BuildOptions.
    from .quant.quant_auto import validate_auto_args
    validate_auto_args(opts)  # refuses the auto flags without --quantization auto, too
    from .quant.smoothquant import resolve_activation_quant
    opts = dataclasses.replace(opts, activation_quant=resolve_activation_quant(opts.activation_quant, opts.quantization))
    if opts.activation_quant != "int8" and (opts.smoothquant_alpha is not None or opts.smoothquant is False):
        raise ValueError(f"--smoothquant-alpha / --no-smoothquant need --activation-quant int8 (the default, auto, "
                         f"gives it to --quantization int8, int4-rtn, int4-awq and int4-gptq; this build's "
                         f"activations: {opts.activation_quant})")
    if opts.activation_quant == "int8" and opts.quantization == "auto":
        raise ValueError("--activation-quant int8 is not available with --quantization auto (its budget is "
                         "measured weight-only); give --quantization int8 or int4-*")
    if opts.quantization != "none" or opts.kv_cache_dtype != "auto" or opts.activation_quant != "none":
        from .quant.quant_pipeline import validate_quant_args
        validate_quant_args(opts)
    ckpt = open_checkpoint(opts.source, opts.allow_pickle)
    # gpt-oss's MXFP4 experts are imported as stored by the family's converter (convert_gpt_oss.py)
    mxfp4 = _mxfp4_source(ckpt)
    imported = None if mxfp4 is not None else _detect_import(ckpt, opts)  # a pre-quantized source, or None
    m = ckpt.model_config
    check_moe_build(m, opts, imported, mxfp4 is not None)
    check_mla_build(m, opts)
    if opts.tensor_parallel_size > 1:  # fail before any work when the model cannot be split
        plan_layout(m, opts.tensor_parallel_size)
    max_seq = opts.max_seq_len or min(m.max_position_embeddings, 2048)
    if max_seq > m.max_position_embeddings:
        raise ValueError(f"--max-seq-len {max_seq} exceeds the model's context "
                         f"({m.max_position_embeddings} positions)")
    cfg = EngineConfig(model=m, dtype=opts.dtype, deterministic=bool(opts.deterministic),
                       activation_quant=opts.activation_quant,
                       limits=Limits(opts.max_batch_size, max_seq, opts.block_size),
                       build={"source": os.path.abspath(opts.source), "tool": f"tritium {TOOL_VERSION}",
                              "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    dtype = TORCH_DTYPES[opts.dtype]
    tensors: Dict[str, torch.Tensor] = {}
    n_expected = 2 + 6 * m.num_layers + (0 if m.tie_word_embeddings else 1) + (m.num_layers if m.attention_bias else 0)
    quant_report: dict = {}
    if imported is not None:
        from .prequant import imported_engine_tensors, imported_quant_config
        with tqdm(total=m.num_layers, desc=f"importing {imported.format} weights", unit="layer",
                  disable=not opts.progress) as bar:
            tensors, plan = imported_engine_tensors(m, ckpt, dtype, imported, opts.source, bar)
        qcfg, quant_report, float_bytes = imported_quant_config(imported, plan, tensors, dtype)
        cfg = dataclasses.replace(cfg, quantization=qcfg)
    else:
        it = hf_to_engine_tensors(m, ckpt.get, ckpt.has, dtype, opts.source)
        for name, t in tqdm(it, total=n_expected, desc="loading weights", unit="tensor", disable=not opts.progress):
            tensors[name] = t.contiguous()
        float_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    if imported is None and (opts.quantization != "none" or opts.kv_cache_dtype != "auto"):
        from .quant.quant_auto import quantize_auto
        from .quant.quant_pipeline import quantize_engine_weights
        quantize = quantize_auto if opts.quantization == "auto" else quantize_engine_weights
        tensors, qcfg, kvcfg, quant_report = quantize(cfg, tensors, opts)
        cfg = dataclasses.replace(cfg, quantization=qcfg, kv_cache=kvcfg)
    elif imported is None:
        from .convert_gpt_oss import mxfp4_quant_config
        cfg = dataclasses.replace(cfg, quantization=QuantConfig() if mxfp4 is None else mxfp4_quant_config(m, mxfp4))
    source_hash = sha256_files(ckpt.source_files(), opts.progress)
    cfg = dataclasses.replace(cfg, build={**cfg.build, "source_sha256": source_hash})
    shards = [tensors]
    if opts.tensor_parallel_size > 1:
        layout, shards = shard_engine_tensors(cfg, tensors, opts.tensor_parallel_size)
        cfg = dataclasses.replace(cfg, tensor_parallel_size=opts.tensor_parallel_size, tensor_parallel=layout)
    cfg.validate()

    check_output_dir(opts.output, opts.source)  # again: the build took a while
    tmp = new_build_dir(out)
    try:
        with tqdm(total=2 + len(shards), desc="writing engine", unit="step", disable=not opts.progress) as bar:
            for rank, shard in enumerate(shards):
                save_file(shard, os.path.join(tmp, cfg.weights_file(rank)),
                          metadata={"format": "tritium-engine", "format_version": str(cfg.format_version),
                                    "rank": str(rank), "tensor_parallel_size": str(len(shards))})
                bar.update()
            tok_files = _write_tokenizer(ckpt, tmp)
            bar.update()
            cfg.save(tmp)
            report = {
                "parameters": int(sum(t.numel() for n, t in tensors.items()
                                      if not n.endswith(("scales", "zeros", "g_idx", "k_scale", "v_scale", "k_offset", "v_offset")))),
                "bytes": component_bytes(tensors),
                "size": size_report(tensors, m.tie_word_embeddings,
                                    tuple(n for n, lq in cfg.quantization.layers.items() if lq.method == "int6")),
                "float_bytes": float_bytes,
                "build_seconds": round(time.time() - t0, 3),
                "source": os.path.abspath(opts.source),
                "source_sha256": source_hash,
                "dtype": opts.dtype,
                "quantization": cfg.quantization.method,
                "activation_quant": cfg.activation_quant,
                "tensor_parallel_size": opts.tensor_parallel_size,
                **({"rank_bytes": [sum(t.numel() * t.element_size() for t in sh.values()) for sh in shards]}
                   if len(shards) > 1 else {}),
                "tokenizer_files": tok_files,
                "kv_cache": kv_cache_report(cfg),
                **({"quantization_report": quant_report} if quant_report else {}),
            }
            write_json(os.path.join(tmp, BUILD_REPORT_FILE), report)
            bar.update()
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return cfg


def _detect_import(ckpt, opts: BuildOptions):
    """The ImportSpec of a pre-quantized Hugging Face folder (config.json's quantization_config;
    its variant and the build options checked before any work), else None."""
    raw = getattr(ckpt, "raw_config", None)
    if not isinstance(raw, dict):
        return None
    from .prequant import check_import_options, detect_import_in
    spec = detect_import_in(opts.source, raw)
    if spec is not None:
        check_import_options(opts, spec, opts.source)
    return spec


def _mxfp4_source(ckpt):
    """config.json's quantization_config when the source is an MXFP4 gpt-oss checkpoint (a
    safetensors folder, or a GGUF file whose experts are MXFP4: gguf_moe.py), else None."""
    raw = getattr(ckpt, "raw_config", None) or getattr(ckpt, "hf_config", None)
    if not isinstance(raw, dict):
        return None
    from .convert_gpt_oss import mxfp4_source
    return mxfp4_source(raw, os.path.join(getattr(ckpt, "path", ""), "config.json"))


def _write_tokenizer(ckpt, engine_dir: str):
    from .tokenizer_export import copy_hf_tokenizer, export_gguf_tokenizer
    if hasattr(ckpt, "copy_tokenizer_files"):
        return copy_hf_tokenizer(ckpt.copy_tokenizer_files(), engine_dir)
    if ckpt.field("tokenizer.ggml.tokens") is None:
        print(f"warning: {ckpt.path} holds no tokenizer; the engine takes token ids only", file=sys.stderr)
        return []
    return export_gguf_tokenizer(ckpt.path, engine_dir)
