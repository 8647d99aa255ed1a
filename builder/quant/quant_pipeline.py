"""Apply a quantization method to a float engine state dict (the builder's quantize step).

    validate_quant_args(opts)                       -> raises ValueError before any work
    quantize_engine_weights(cfg, tensors, opts)     -> (tensors, QuantConfig, KVCacheConfig, report)

`opts` is the builder's BuildOptions (or any object / keywords with the same fields:
quantization, group_size, kv_cache_dtype, calibration_text, calibration_samples,
exclude_modules, progress, source). Data-free methods (int8, int4-rtn) quantize each linear
directly; AWQ, GPTQ, fp8 (GPTQ error feedback on the E4M3 grid) and a quantized KV cache run the
float model layer by layer over calibration text (inputs of layer i come from the
already-quantized layers < i).
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Dict, Optional, Tuple, Union

import torch

from tritium.backend.config import (SUPPORTED_EMBEDDING_QUANTIZATION, SUPPORTED_KV_CACHE_DTYPES, SUPPORTED_KV_ROTATIONS,
                                    SUPPORTED_QUANTIZATION, EngineConfig, KVCacheConfig, QuantConfig)
from tritium.backend.models.kv_rotation import rotate, rotation_supported
from tritium.kernels.quant_layouts import (FP8_GROUPED_LAYOUT, FP8_LAYOUT, INT4_LAYOUT, INT6_LAYOUT, INT8_GROUPED_LAYOUT,
                                          INT8_LAYOUT)

KV_ROTATION_CHOICES = ("auto",) + SUPPORTED_KV_ROTATIONS

from .. import calibration as calib
from ..calibration_mix import mix_samples, source_chat_template
from .kv_scales import (KV_OFFSET_METHODS, KV_SCALE_METHODS, attention_weighted_offsets, kv_head_offsets,
                        kv_head_scales)
from ..heldout_eval import evaluate_held_out
from ..layer_progress import LayerProgress
from ..source_tokenizer import load_source_tokenizer  # noqa: F401  (re-exported: quant_auto, tests)
from .quant_eval import evaluate
from .quant_head import centred_head, collect_head_stats, head_name, quantize_embeddings
from .quant_layers import LINEARS, quantize_layer
from .quant_moe import moe_plan, quantize_experts
from .quantize_fp8 import has_float8
from .quantize_int4 import SUPPORTED_GROUP_SIZES
from .quant_plan import DEFAULT_GROUP_SIZE, PER_ROW, int4_symmetric, plan_layers
from .smoothquant import (DEFAULT_ALPHA, check_activation_options, resolve_activation_quant, smoothquant_applies,
                          smoothquant_off)
from .smoothquant_search import smooth_engine_tensors

DEFAULT_CALIBRATION_SAMPLES = 64
DEFAULT_EVAL_TOKENS = 1024  # per held-out domain
CALIBRATED = ("int4-awq", "int4-gptq")
HESSIAN_METHODS = ("int4-gptq", "fp8")  # calibrated methods that collect GPTQ Hessians

@dataclasses.dataclass
class QuantOptions:
    """The quantization fields of a build (the flags of `tritium build`, see client/cli/build_cli.py)."""
    quantization: str = "none"
    group_size: int = DEFAULT_GROUP_SIZE
    group_size_explicit: bool = False   # --group-size was given (else per-layer source grids may win)
    kv_cache_dtype: str = "auto"
    kv_rotation: str = "auto"
    calibration_text: Optional[str] = None
    calibration_samples: int = DEFAULT_CALIBRATION_SAMPLES
    exclude_modules: Optional[str] = None
    embedding_quantization: str = "auto"  # SUPPORTED_EMBEDDING_QUANTIZATION (quant_plan.plan_embedding)
    int4_layout: Optional[str] = None  # INT4_LAYOUTS (quant_plan.int4_symmetric); None: asymmetric
    progress: bool = True
    source: Optional[str] = None
    act_order: bool = True
    eval_tokens: int = DEFAULT_EVAL_TOKENS
    tensor_parallel_size: int = 1  # > 1: int4-gptq's o_proj uses static groups (see quant_plan.plan_layers)
    # --quantization auto (builder/quant/quant_auto.py): the budget and its flags, and the per-linear
    # plan it hands back to this pipeline ({name: LayerQuant}; replaces plan_layers when given).
    max_ppl_increase: Optional[float] = None
    auto_int4_method: Optional[str] = None
    auto_candidates: Optional[str] = None
    layer_plan: Optional[dict] = None
    # centre the int8 LM head (None: centred_head's default: int8 W8A8 builds, quant_head's for int4-awq)
    head_centring: Optional[bool] = None
    kv_offsets: str = "mean"  # quantized KV cache: kv_scales.KV_OFFSET_METHODS
    # --activation-quant int8: W8A8 / W4A8 at run time; SmoothQuant first (smoothquant.smoothquant_applies).
    # "auto" (BuildOptions' default) resolves as smoothquant.resolve_activation_quant; a QuantOptions
    # made by hand stays weight-only unless asked.
    activation_quant: str = "none"
    smoothquant: Optional[bool] = None
    smoothquant_alpha: Optional[Union[float, str]] = None  # a number in [0, 1] or "auto"; None: DEFAULT_ALPHA

    def __post_init__(self):
        self.activation_quant = resolve_activation_quant(self.activation_quant, self.quantization)

    @classmethod
    def of(cls, opts=None, **kw) -> "QuantOptions":
        """From a BuildOptions (or any object with these fields) and/or keywords; a None value
        (from either) keeps the default. A QuantOptions without keywords is returned as is."""
        if isinstance(opts, cls) and not kw:
            return opts
        names = [f.name for f in dataclasses.fields(cls)]
        given = {k: getattr(opts, k) for k in names if opts is not None and hasattr(opts, k)}
        given.update(kw)
        given = {k: v for k, v in given.items() if v is not None and k in names}
        if "group_size_explicit" not in given:
            given["group_size_explicit"] = "group_size" in given
        return cls(**given)


def validate_quant_args(opts=None, cfg: Optional[EngineConfig] = None, **kw) -> None:
    """Check quantization options before any work; raises ValueError naming the flag."""
    o = QuantOptions.of(opts, **kw)
    if o.quantization not in SUPPORTED_QUANTIZATION:
        raise ValueError(f"--quantization {o.quantization!r} not supported; allowed: "
                         f"{', '.join(SUPPORTED_QUANTIZATION)}")
    if o.kv_cache_dtype not in SUPPORTED_KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {o.kv_cache_dtype!r} not supported; allowed: "
                         f"{', '.join(SUPPORTED_KV_CACHE_DTYPES)}")
    if o.kv_rotation not in KV_ROTATION_CHOICES:
        raise ValueError(f"--kv-rotation {o.kv_rotation!r} not supported; allowed: "
                         f"{', '.join(KV_ROTATION_CHOICES)}")
    if o.kv_rotation == "hadamard" and o.kv_cache_dtype == "auto":
        raise ValueError("--kv-rotation hadamard needs a quantized cache: --kv-cache-dtype fp8 or int8")
    if cfg is not None and o.kv_rotation == "hadamard" and not rotation_supported(cfg.model.head_dim):
        raise ValueError(f"--kv-rotation hadamard needs head_dim a power of two; this model's is "
                         f"{cfg.model.head_dim}")
    if o.quantization.startswith("int4") and o.group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"--group-size {o.group_size} fits no layer; allowed: "
                         f"{', '.join(map(str, SUPPORTED_GROUP_SIZES))} (falls back to 64/32 per layer)")
    if not isinstance(o.eval_tokens, int) or o.eval_tokens < 0 or o.eval_tokens == 1:
        raise ValueError(f"--eval-tokens must be 0 (no evaluation) or >= 2, got {o.eval_tokens}")
    if o.quantization in ("int8", "fp8") and o.group_size not in SUPPORTED_GROUP_SIZES + (PER_ROW,):
        raise ValueError(f"--group-size {o.group_size} not supported for {o.quantization}; allowed: "
                         f"{PER_ROW} (one scale per output channel) or "
                         f"{', '.join(map(str, SUPPORTED_GROUP_SIZES))} (falls back to 64/32 per layer)")
    int4_symmetric(o)  # --int4-layout
    if o.embedding_quantization not in SUPPORTED_EMBEDDING_QUANTIZATION:
        raise ValueError(f"--embedding-quantization {o.embedding_quantization!r} not supported; allowed: "
                         f"{', '.join(SUPPORTED_EMBEDDING_QUANTIZATION)}")
    if o.embedding_quantization != "auto" and o.quantization in ("none", "auto"):
        raise ValueError(f"--embedding-quantization {o.embedding_quantization} needs --quantization int8, fp8, "
                         f"int4-rtn, int4-awq or int4-gptq"
                         + (" (--quantization auto picks the embedding's format itself)" if o.quantization == "auto" else ""))
    if not isinstance(o.calibration_samples, int) or o.calibration_samples < 1:
        raise ValueError(f"--calibration-samples must be >= 1, got {o.calibration_samples}")
    if (o.quantization == "fp8" or o.kv_cache_dtype == "fp8") and not has_float8():
        raise ValueError("--quantization/--kv-cache-dtype fp8 needs a torch build with float8_e4m3fn "
                         f"(torch {torch.__version__} has none)")
    if o.calibration_text is not None:
        text = _read_text(o.calibration_text, "--calibration-text")
        if len(text) < calib.MIN_CALIBRATION_CHARS:
            raise ValueError(f"--calibration-text {o.calibration_text}: calibration text too short "
                             f"({len(text)} characters, need at least {calib.MIN_CALIBRATION_CHARS})")
    check_activation_options(o)
    if cfg is not None and o.quantization != "none":
        plan_layers(cfg, o)  # raises if a layer's input dim takes no group size


def resolve_kv_rotation(kv_rotation: str, kv_cache_dtype: str, head_dim: int) -> str:
    """--kv-rotation auto: Hadamard-rotate a quantized cache whenever head_dim allows it. On
    SmolLM2 (44k eval tokens, float32 weights) it cut the mean KL of an FP8 cache from 0.0078 to
    0.0042 and of an INT8 cache from 0.0023 to 0.0008; a float cache is never rotated."""
    if kv_rotation != "auto":
        return kv_rotation
    return "hadamard" if kv_cache_dtype != "auto" and rotation_supported(head_dim) else "none"


def _read_text(path: str, flag: str) -> str:
    if not os.path.isfile(path):
        raise ValueError(f"{flag} {path}: file not found")
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def _float_model(cfg: EngineConfig, tensors, model_factory=None):
    from tritium.backend.models.decoder import DecoderLM
    fcfg = dataclasses.replace(cfg, quantization=QuantConfig(), kv_cache=KVCacheConfig())
    model = (model_factory or DecoderLM)(fcfg)
    model.load_engine_weights(tensors)
    return model.eval()


def quantize_engine_weights(cfg: EngineConfig, tensors: Dict[str, torch.Tensor], opts=None, *,
                            model_factory=None, tokenizer=None, **kw
                            ) -> Tuple[Dict[str, torch.Tensor], QuantConfig, KVCacheConfig, dict]:
    """Quantize a float engine state dict per `opts` (BuildOptions or keywords, see module doc).

    Returns (new tensors, QuantConfig with per-layer choices and layouts, KVCacheConfig, report)."""
    o = QuantOptions.of(opts, **kw)
    validate_quant_args(o, cfg)
    if o.quantization == "auto":
        raise ValueError("--quantization auto is built by builder/quant/quant_auto.py (quantize_auto), which hands "
                         "this pipeline an int4 method and a per-layer plan")
    t0 = time.time()
    if o.quantization == "none" and o.kv_cache_dtype == "auto":
        return dict(tensors), QuantConfig(), KVCacheConfig(), {}
    plan = {} if o.quantization == "none" else dict(o.layer_plan) if o.layer_plan is not None else plan_layers(cfg, o)
    if cfg.model.num_experts and plan:
        plan = moe_plan(cfg, plan, o)
    kv_rotation = resolve_kv_rotation(o.kv_rotation, o.kv_cache_dtype, cfg.model.head_dim)
    tokenizer = tokenizer or load_source_tokenizer(o.source)
    o = dataclasses.replace(o, head_centring=centred_head(o, tokenizer))
    # fp8 uses GPTQ error feedback when calibration text can be tokenized, else plain rounding;
    # not when every fp8 linear keeps its source grid (asymmetric groups on the source blocks,
    # exact there: the error GPTQ would feed back is zero).
    fp8_gptq = any(lq.method == "fp8" and not lq.asymmetric for lq in plan.values())
    calibrated = o.quantization in CALIBRATED or (o.quantization == "fp8" and tokenizer is not None and fp8_gptq)
    float_tensors, smooth_report = tensors, None
    if smoothquant_applies(o, tokenizer) and plan:  # SmoothQuant on the float weights first
        tensors, smooth_report = smooth_engine_tensors(
            cfg, tensors, lambda: _calibration_runner(_float_model(cfg, tensors, model_factory), tokenizer, o),
            plan, DEFAULT_ALPHA if o.smoothquant_alpha is None else o.smoothquant_alpha, o.quantization,
            LayerProgress("SmoothQuant scales", cfg.model.num_layers, enabled=o.progress))
    model = _float_model(cfg, tensors, model_factory)
    runner, calibration_info = None, {}
    if calibrated or o.kv_cache_dtype != "auto" or (o.head_centring and head_name(plan, cfg.model.tie_word_embeddings)):
        runner, calibration_info = _calibration_runner(model, tokenizer, o)
    new = dict(tensors)
    layer_reports, kv_scales, head_stats = _quantize_layers(cfg, model, new, plan, o, runner, calibrated,
                                                            kv_rotation)
    # int4 builds: per-row int8 embedding / LM head, the head rounded by the build's method
    layer_reports.update(quantize_embeddings(new, plan, o.quantization, cfg.model.tie_word_embeddings,
                                             head_stats, centre=o.head_centring))
    new.update(kv_scales)
    layouts = {"int4": INT4_LAYOUT, "int8": INT8_LAYOUT, "fp8": FP8_LAYOUT, "int6": INT6_LAYOUT,
               "int8 grouped": INT8_GROUPED_LAYOUT, "fp8 grouped": FP8_GROUPED_LAYOUT}
    used = {lq.method + (" grouped" if lq.method in ("int8", "fp8") and lq.group_size else "")
            for lq in plan.values()}
    qcfg = QuantConfig(method=o.quantization,
                       group_size=o.group_size if o.quantization.startswith("int4") or (
                           o.quantization in ("int8", "fp8") and o.group_size_explicit) else None,
                       layers=dict(plan),
                       layouts={k: v for k, v in layouts.items() if k in used},
                       calibration=calibration_info)
    kvcfg = KVCacheConfig(dtype=o.kv_cache_dtype, rotation=kv_rotation)
    if smooth_report is not None:
        qcfg = dataclasses.replace(qcfg, smoothquant={k: smooth_report[k] for k in ("alpha", "linears", "alpha_counts")
                                                          if k in smooth_report})
    report = _report(o, float_tensors, new, layer_reports, calibrated, kv_rotation, time.time() - t0)
    if o.activation_quant != "none":
        report.update(activation_quant=o.activation_quant, smoothquant=smooth_report or smoothquant_off(o, tokenizer))
    if tokenizer is not None and o.eval_tokens:
        report["eval"] = _eval_vs_float(cfg, float_tensors, new, qcfg, kvcfg, tokenizer, o, model_factory)
    return new, qcfg, kvcfg, report


def _calibration_runner(model, tokenizer, o: QuantOptions):
    """(LayerwiseRunner over the calibration samples, the calibration's provenance for engine.json)."""
    if tokenizer is None:
        raise ValueError("calibration needs the source's tokenizer (tokenizer.json or a GGUF vocabulary)")
    if o.calibration_text:
        text = _read_text(o.calibration_text, "--calibration-text")
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        samples = calib.calibration_samples(ids, o.calibration_samples)
        info = calib.text_provenance(text, o.calibration_text)
    else:  # the shipped mix of prose, dialogue (in the source's chat format) and code
        samples, info = mix_samples(tokenizer, o.calibration_samples, calib.CALIBRATION_SEQ_LEN,
                                    source_chat_template(o.source))
    info = {**info, "samples": len(samples), "seq_len": len(samples[0]), "tokens": sum(map(len, samples))}
    return calib.LayerwiseRunner(model, samples), info


def _quantize_layers(cfg: EngineConfig, model, new: dict, plan: dict, o: QuantOptions, runner,
                     calibrated: bool, kv_rotation: str):
    """Quantize the decoder layers in order (into `new`); with a runner, each quantized layer is
    re-run so layer i+1 calibrates on its outputs and the KV cache scales come from its K/V.
    Returns (per-layer reports, KV scale / offset tensors, LM head statistics or None)."""
    layer_reports: dict = {}
    kv_scales: dict = {}
    # int4-awq / int4-gptq quantize the int8 LM head with their own method: it needs the final
    # hidden states of the quantized model, so the last layer is run forward too.
    head_calibrated = ((o.quantization in CALIBRATED or bool(o.head_centring))
                       and head_name(plan, cfg.model.tie_word_embeddings) is not None)
    progress = LayerProgress(f"quantizing ({o.quantization})", cfg.model.num_layers, enabled=o.progress)
    for i in range(cfg.model.num_layers):
        layer = model.layers[i]
        stats = _collect_layer_inputs(runner, i, o.quantization) if calibrated else None
        layer_reports.update(quantize_layer(cfg, i, layer, new, plan, o.quantization, stats))
        if cfg.model.sparse(i):
            experts = stats.pop("experts").finish() if stats and "experts" in stats else None
            layer_reports.update(quantize_experts(cfg, i, layer, new, plan, o.quantization, experts))
        if runner is None or not (i < cfg.model.num_layers - 1 or o.kv_cache_dtype != "auto" or head_calibrated):
            progress.done(i)
            continue
        kv_stats: dict = {}
        handle, pos = None, ({} if o.kv_offsets == "attention" else None)
        if o.kv_cache_dtype != "auto":
            hook = calib.kv_sample_hook(layer, model.rope_cache_of(layer), kv_stats, seed=i, positions=pos)
            handle = layer.qkv_proj.register_forward_hook(hook)
        # Re-run the now-quantized layer: its outputs feed layer i+1, its K/V give the scales.
        runner.run_layer(i, advance=True, on_chunk=None if pos is None else (lambda p: pos.__setitem__("p", p)))
        if handle is not None:
            handle.remove()
            for key in ("k", "v"):
                x = torch.cat(kv_stats[key])
                offset = kv_head_offsets(x) if pos is None else attention_weighted_offsets(kv_stats, key)
                if o.kv_offsets == "none":
                    offset = torch.zeros_like(offset)
                kv_scales[f"layers.{i}.{key}_offset"] = offset
                x = x - offset
                if kv_rotation == "hadamard":
                    x = rotate(x)  # the scales fit what the cache stores
                kv_scales[f"layers.{i}.{key}_scale"] = kv_head_scales(x, o.kv_cache_dtype)
        progress.done(i)
    head_stats = collect_head_stats(runner) if head_calibrated else None
    return layer_reports, kv_scales, head_stats


def _report(o: QuantOptions, float_tensors: dict, new: dict, layer_reports: dict, calibrated: bool,
            kv_rotation: str, seconds: float) -> dict:
    """The quantization part of build_report.json (the held-out evaluation is added after)."""
    report = {"method": o.quantization, "kv_cache_dtype": o.kv_cache_dtype,
              "quantize_seconds": round(seconds, 2),
              "weight_bytes": _nbytes(new), "float_weight_bytes": _nbytes(float_tensors),
              "layers": layer_reports}
    report["weight_bytes_ratio"] = report["weight_bytes"] / report["float_weight_bytes"]
    if o.quantization == "fp8":
        report["fp8_rounding"] = ("GPTQ error feedback on the E4M3 grid (act-order)" if calibrated
                                  else "round to nearest (source grid kept)" if not _fp8_needs_gptq(layer_reports)
                                  else "round to nearest (no tokenizer for calibration)")
    if o.kv_cache_dtype != "auto":
        report["kv_scales"] = KV_SCALE_METHODS[o.kv_cache_dtype]
        report["kv_offsets"] = KV_OFFSET_METHODS[o.kv_offsets]
        report["kv_rotation"] = kv_rotation
    return report


def _fp8_needs_gptq(layer_reports: dict) -> bool:
    return any(e.get("method") == "fp8" and "source grid" not in (e.get("group_reason") or "")
               for e in layer_reports.values())


def _nbytes(tensors) -> int:
    return int(sum(t.numel() * t.element_size() for t in tensors.values()))


def _collect_layer_inputs(runner, i: int, method: str) -> dict:
    """Run layer i over the calibration set with hooks on its linears' inputs.
    GPTQ keeps a Hessian per input; AWQ keeps mean |x| and a strided subsample of rows."""
    from .gptq import HessianAccumulator
    layer = runner.model.layers[i]
    mods = {lin: getattr(layer, lin) for lin in LINEARS if hasattr(layer, lin)}  # a sparse layer: no dense MLP
    stats: dict = {lin: {} for lin in mods}

    def on_input(name, x):
        s = stats[name]
        if method in HESSIAN_METHODS or method == "int4-awq":  # AWQ: its loss over all tokens
            s.setdefault("H", HessianAccumulator(x.shape[1])).add(x)
        if method not in HESSIAN_METHODS:
            s["abs_sum"] = s.get("abs_sum", 0) + x.abs().sum(0)
            s["n"] = s.get("n", 0) + x.shape[0]
            stride = max(1, runner.num_tokens // AWQ_SEARCH_TOKENS)
            s.setdefault("rows", []).append(x[::stride])
    handles = calib.capture_inputs(mods, on_input)
    if getattr(layer, "sparse", False) and method in HESSIAN_METHODS:  # GPTQ per expert
        from .moe_calibration import ExpertHessians
        stats["experts"] = ExpertHessians(layer)
        handles.append(stats["experts"].hook())
    try:
        runner.run_layer(i)
    finally:
        for h in handles:
            h.remove()
    for s in stats.values():
        if isinstance(s, dict) and "rows" in s:
            s["x"] = torch.cat(s.pop("rows"))[:AWQ_SEARCH_TOKENS]
            s["mean_abs"] = s.pop("abs_sum") / s["n"]
    return stats


AWQ_SEARCH_TOKENS = 512  # calibration rows per linear used in AWQ's grid search


def _eval_vs_float(cfg, float_tensors, q_tensors, qcfg, kvcfg, tokenizer, o, model_factory) -> dict:
    """Perplexity / KL / top-1 of the quantized model against the float one on every held-out
    domain (calibration_mix.HELD_OUT_DOMAINS), o.eval_tokens tokens each."""
    from tritium.backend.models.decoder import DecoderLM
    ref = _float_model(cfg, float_tensors, model_factory)
    qmodel = (model_factory or DecoderLM)(dataclasses.replace(cfg, quantization=qcfg, kv_cache=kvcfg))
    qmodel.load_engine_weights(q_tensors)
    if o.activation_quant != "none":
        from tritium.backend.quant import set_activation_quant
        set_activation_quant(qmodel, o.activation_quant)
    result = evaluate_held_out(qmodel.eval(), ref, tokenizer, o.eval_tokens, progress=o.progress)
    if o.layer_plan is not None:
        # --quantization auto checks its budget on the worst of the budget mix's domains
        # (quant_auto_budget.py; never a held-out domain, so the domains above stay an
        # independent score of the chosen plan)
        from .quant_auto_budget import BUDGET_DOMAINS, budget_texts
        per = {d: evaluate(qmodel, ids, reference=ref, progress=o.progress)
               for d, ids in budget_texts(tokenizer, o.eval_tokens).items()}
        w = max(per, key=lambda d: per[d]["perplexity_increase"])
        result["budget_check"] = {**{k: per[w][k] for k in ("perplexity", "perplexity_increase", "mean_kl",
                                                             "top1_agreement")},
                                  "tokens": sum(p["tokens"] for p in per.values()),
                                  "tokens_per_domain": [per[d]["tokens"] for d in BUDGET_DOMAINS],
                                  "domains": {d: per[d]["perplexity_increase"] for d in BUDGET_DOMAINS},
                                  "text": f"budget mix {'+'.join(BUDGET_DOMAINS)} (worst: {w})"}
    return result
