"""`tritium build SOURCE -o ENGINE_DIR [...]`: compile a checkpoint into an engine."""
from __future__ import annotations

import argparse
import os
import sys

from tritium.backend import engine_options
from tritium.backend.config import (BUILD_REPORT_FILE, ENGINE_CONFIG_FILE, SUPPORTED_DTYPES,
                                    SUPPORTED_EMBEDDING_QUANTIZATION,
                                    SUPPORTED_KV_CACHE_DTYPES, SUPPORTED_KV_ROTATIONS, SUPPORTED_QUANTIZATION)
from tritium.kernels.quant_layouts import INT4_LAYOUTS
from tritium.builder.quant.smoothquant import ACTIVATION_QUANT_CHOICES
from tritium.backend.engine_options import (SPECULATIVE, add_option_arguments, lora_adapters_from_args,
                                           speculative_config, to_params)
from tritium.backend.speculative.config import DEFAULT_NUM_SPECULATIVE_TOKENS


def register(sub) -> None:
    p = sub.add_parser("build", help="compile a Hugging Face checkpoint or GGUF file into an engine",
                       description="Compile a Hugging Face checkpoint folder (config.json + *.safetensors + "
                                   "tokenizer) or a GGUF file into a versioned Tritium engine directory.")
    p.add_argument("source", help="checkpoint folder or .gguf file; a folder whose config.json has a quantization_config "
                                  "(GPTQ, AWQ, compressed-tensors) is imported as stored, without re-quantizing "
                                  "(docs/quantization.md)")
    p.add_argument("-o", "--output", required=True, help="engine directory to write: new, empty, or an earlier engine (replaced in one "
                        "rename); any other folder is refused")
    p.add_argument("--dtype", default="bfloat16", choices=SUPPORTED_DTYPES,
                   help="float dtype of weights and activations (default bfloat16)")
    p.add_argument("--max-batch-size", type=int, default=64, help="max concurrent sequences (default 64)")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="max prompt + output tokens per sequence (default: min(model context, 2048))")
    p.add_argument("--block-size", type=int, default=16, help="KV-cache block size in tokens (default 16)")
    p.add_argument("--allow-pickle", action="store_true",
                   help="allow *.bin/*.pt checkpoints (unpickling can run arbitrary code)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    # Quantization (builder/quant/quant_pipeline.py).
    p.add_argument("--quantization", default="none", choices=SUPPORTED_QUANTIZATION,
                   help="weight quantization of a float source (default none; refused for a pre-quantized one)")
    p.add_argument("--group-size", type=int, default=None,
                   help="int4 group size for every layer (default: a GGUF linear stored block-quantized, e.g. "
                        "Q4_1, uses its block size 32; otherwise 128, per layer falling back to 64 or 32 "
                        "when 128 does not divide). int8 / fp8: symmetric groups of this size (same fallback), "
                        "or -1 for one scale per output channel; default: a block-quantized GGUF linear keeps "
                        "its source grid (asymmetric groups on its blocks), others one scale per output channel")
    p.add_argument("--kv-cache-dtype", default="auto", choices=SUPPORTED_KV_CACHE_DTYPES,
                   help="KV-cache dtype: auto (= --dtype), fp8 (E4M3) or int8, with per-head scales")
    p.add_argument("--kv-rotation", default="auto", choices=("auto",) + SUPPORTED_KV_ROTATIONS,
                   help="quantized KV cache only: store K and V Hadamard-rotated over head_dim, exact in real "
                        "arithmetic, spreading outlier channels before rounding (default auto: hadamard when "
                        "--kv-cache-dtype is fp8/int8 and head_dim is a power of two, else none)")
    p.add_argument("--calibration-text", default=None, metavar="FILE",
                   help="UTF-8 calibration text, replacing the default: the shipped mix of prose, dialogue (in the "
                        "model's chat format) and code (docs/quantization.md#calibration)")
    p.add_argument("--calibration-samples", type=int, default=None, metavar="N",
                   help="calibration windows of 128 tokens (default 64)")
    p.add_argument("--eval-tokens", type=int, default=None, metavar="N",
                   help="quantized builds: tokens of each held-out domain (kjv, devil) the build report scores "
                        "against the float model (default 1024; 0 skips the evaluation)")
    p.add_argument("--exclude-modules", default=None, metavar="PATTERN",
                   help="comma-separated globs of linears kept in float, e.g. 'layers.0.*,*.down_proj'")
    s = p.add_argument_group("integer-dot activations (docs/quantization.md#integer-dot-w8a8--w4a8)")
    s.add_argument("--activation-quant", default="auto", choices=ACTIVATION_QUANT_CHOICES,
                   help="int8: the engine's int8 / int4 linears quantize activations per row and block of 32 to int8 "
                        "and run integer dot products on CPU (W8A8 / W4A8), int8 weights after SmoothQuant; none: "
                        "weight-only (W8A16 / W4A16 numerics); auto (default): int8 for --quantization int8, int4-rtn, "
                        "int4-awq and int4-gptq, none for every other build (float, fp8, --quantization auto, "
                        "imported pre-quantized checkpoints). GPUs run weight-only either way. The backend parameter "
                        "/ engine option activation_quant overrides it at run time")
    s.add_argument("--smoothquant-alpha", type=_alpha, default=None, metavar="A",
                   help="int8 activations: SmoothQuant's migration strength, a number in [0, 1] for every linear "
                        "(default 0.5), or auto: per linear the least W8A8 output error on the calibration set among "
                        "unsmoothed, 0.25, 0.5, 0.75 and 0.9; given, SmoothQuant also runs for int4 weights (off for "
                        "them by default)")
    s.add_argument("--no-smoothquant", dest="smoothquant", action="store_const", const=False, default=None,
                   help="int8 activations: do not smooth activation outliers into the weights")
    p.add_argument("--int4-layout", default=None, choices=INT4_LAYOUTS,
                   help="int4 linears: asymmetric (default: a float16 scale and zero point per group, 5 bits per "
                        "weight at groups of 32; keeps a GGUF Q4_1 source's grid exactly) or symmetric (codes -8..7 "
                        "times one float16 scale per group, llama.cpp Q4_0's grid, 4.5 bits)")
    p.add_argument("--embedding-quantization", default=None, choices=SUPPORTED_EMBEDDING_QUANTIZATION,
                   help="the embedding / LM head of a quantized build: int8 (symmetric groups of 32, float16 "
                        "scales; one scale per row in int4 builds), int6 (6-bit codes, float16 scale per 64: 6.25 "
                        "bits), int4 (asymmetric groups of 32), none (float), or auto (default: int6 in int4 builds, "
                        "rounded by their method; int8 in groups of 32 in int8 / fp8 builds)")
    a = p.add_argument_group("--quantization auto: per-layer precision under a quality budget (docs/quantization.md)")
    a.add_argument("--max-ppl-increase", type=float, default=None, metavar="PCT",
                   help="required with --quantization auto: the allowed perplexity increase over the float model, "
                        "in percent, measured on held-out text (e.g. 0.5); the build picks int4 / int8 / float "
                        "and the int4 group size per linear for the fewest bytes within it, and exits with "
                        "status 3 (engine still written, report says so) when it cannot be met")
    a.add_argument("--auto-int4-method", default=None, choices=("int4-rtn", "int4-awq", "int4-gptq"),
                   help="how the int4 layers of an auto build are rounded (default int4-rtn: the budget check is then exact)")
    a.add_argument("--auto-candidates", default=None, metavar="KINDS",
                   help="formats an auto build may pick, comma-separated from int4,int8,none (default all; "
                        "'none' = float)")
    p.add_argument("--deterministic", action="store_true",
                   help="batch-invariant kernels only: never oneDNN's bf16 GEMMs, whose K blocking depends on "
                        "the batch (docs/determinism.md; the default is already invariant wherever the native "
                        "CPU kernels run, oneDNN kept only for K <= 1024 on AVX512-BF16); the backend parameter `deterministic` overrides it")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="split the weights over N tensor-parallel ranks, written as rank0..rank{N-1}.safetensors "
                        "(Megatron-style; see docs/tensor-parallel.md); the runtime then drives N processes (default 1)")
    p.add_argument("--repo", default=None, help="also write a Triton model repository here (NAME, "
                   "NAME_preprocessing, NAME_postprocessing, NAME_ensemble, NAME_bls)")
    p.add_argument("--instances", type=int, default=1, metavar="N",
                   help="with --repo: engine replicas in one server (Triton instance_group count; each loads the "
                        "engine, and its tensor-parallel workers, once; default 1)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="with --repo: where the engine instances run: cpu (KIND_CPU) or cuda (KIND_GPU; each "
                        "instance on cuda:<its GPU id>; default cpu)")
    p.add_argument("--gpus", default=None, metavar="IDS",
                   help="with --repo --device cuda: comma-separated GPU ids; --instances replicas run on each "
                        "(default 0); they share that GPU's gpu_memory_utilization budget")
    p.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="F",
                   help="with --repo --device cuda: fraction (0, 1] of each GPU's memory the instances on it "
                        "share for weights and KV cache (backend parameter gpu_memory_utilization; default 0.85)")
    p.add_argument("--name", default=None, help="model name in --repo (default: the engine folder's name)")
    add_option_arguments(p, SPECULATIVE, "speculative decoding in --repo (docs/speculative.md)")
    from tritium.builder.lora_repo import add_lora_arguments
    add_lora_arguments(p)
    p.set_defaults(func=run)


def _alpha(value: str):
    """--smoothquant-alpha: a number, else the string as given ("auto"; anything else is refused
    with the other flags, smoothquant.check_activation_options, in one line)."""
    try:
        return float(value)
    except ValueError:
        return value


def speculative_params(args: argparse.Namespace) -> dict:
    """--speculative / --draft-engine / --num-speculative-tokens -> config.pbtxt parameters (checked)."""
    opts = engine_options.options_from_args(args, SPECULATIVE)
    if speculative_config(opts) is None:
        return {}
    if not getattr(args, "repo", None):
        raise ValueError("--speculative configures the served model: it needs --repo")
    draft = opts.get("draft_engine_dir")
    if draft is not None:
        if not os.path.isfile(os.path.join(os.path.expanduser(draft), ENGINE_CONFIG_FILE)):
            raise ValueError(f"--draft-engine {draft}: no {ENGINE_CONFIG_FILE} there; build the draft engine first")
        opts["draft_engine_dir"] = draft if draft.startswith("~") else os.path.abspath(draft)
    opts.setdefault("num_speculative_tokens", DEFAULT_NUM_SPECULATIVE_TOKENS)
    return to_params(opts)


def placement_args(args: argparse.Namespace) -> dict:
    """--device / --gpus / --gpu-memory-utilization -> instance group and parameters (checked)."""
    from tritium.backend.placement import check_utilization
    from tritium.builder.repository import instance_group, parse_gpus
    device, gpus = getattr(args, "device", "cpu"), parse_gpus(getattr(args, "gpus", None))
    util = getattr(args, "gpu_memory_utilization", None)
    if (device != "cpu" or gpus or util is not None) and not getattr(args, "repo", None):
        raise ValueError("--device / --gpus / --gpu-memory-utilization configure the served model: they need --repo")
    if util is not None and device != "cuda":
        raise ValueError("--gpu-memory-utilization needs --device cuda")
    instance_group(device, getattr(args, "instances", 1), gpus)
    params = {} if util is None else {"gpu_memory_utilization": str(check_utilization(util))}
    return {"device": device, "gpus": gpus, "params": params}


def options_from_args(args: argparse.Namespace):
    from tritium.builder.build import BuildOptions
    extra = {k: getattr(args, k) for k in ("quantization", "group_size", "kv_cache_dtype", "kv_rotation", "calibration_text",
                                           "calibration_samples", "exclude_modules", "embedding_quantization",
                                           "int4_layout", "tensor_parallel_size",
                                           "max_ppl_increase", "auto_int4_method", "auto_candidates",
                                           "eval_tokens", "activation_quant", "smoothquant", "smoothquant_alpha")
             if hasattr(args, k)}
    if lora_adapters_from_args(args) and extra.get("smoothquant") is None:
        # an adapter acts on a linear's input, which SmoothQuant scales (backend/lora/setup.check_unsmoothed)
        if extra.get("smoothquant_alpha") is not None:
            raise ValueError("--smoothquant-alpha: SmoothQuant scales each linear's input, so the --lora adapters "
                             "could not apply; drop it (builds with --lora are not smoothed)")
        from tritium.builder.quant.smoothquant import resolve_activation_quant
        if resolve_activation_quant(extra.get("activation_quant", "auto"), extra.get("quantization") or "none") == "int8":
            extra["smoothquant"] = False
    return BuildOptions(source=args.source, output=args.output, dtype=args.dtype,
                        max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len,
                        block_size=args.block_size, allow_pickle=args.allow_pickle,
                        deterministic=bool(getattr(args, "deterministic", False)),
                        progress=not args.quiet, **extra)


def run(args: argparse.Namespace) -> int:
    from tritium.builder.build import build_engine
    if getattr(args, "instances", 1) < 1:  # before the build, not after it
        raise ValueError(f"--instances must be an integer >= 1, got {args.instances}")
    spec_params = speculative_params(args)  # checked before the (long) build
    placement = placement_args(args)  # likewise
    from tritium.builder.lora_repo import check_lora_after_build, lora_params
    spec_params.update(lora_params(args))  # adapters' folders checked before the build too
    opts = options_from_args(args)
    cfg = build_engine(opts)
    check_lora_after_build(args, cfg)  # shapes and modules against the engine, before the repository
    m = cfg.model
    print(f"engine written to {args.output}: {m.architecture}, {m.num_layers} layers, hidden {m.hidden_size}, "
          f"dtype {cfg.dtype}, quantization {cfg.quantization.method}"
          f"{f', tensor parallel {cfg.tensor_parallel_size} ranks' if cfg.tensor_parallel_size > 1 else ''}", file=sys.stderr)
    _print_quality(args.output)
    if opts.smoothquant is False and getattr(args, "smoothquant", None) is None:
        print("SmoothQuant is off because the engine serves --lora adapters: it would scale the inputs the "
              "adapters act on (docs/lora.md)", file=sys.stderr)
    if getattr(args, "repo", None):
        from tritium.builder.repository import write_repository
        name = args.name or os.path.basename(os.path.normpath(args.output))
        models = write_repository(args.repo, name, args.output, instances=getattr(args, "instances", 1),
                                  engine_params=dict(spec_params, **placement["params"]),
                                  device=placement["device"], gpus=placement["gpus"])
        print(f"repository written to {args.repo}: {', '.join(models)}", file=sys.stderr)
    return _budget_status(cfg.quantization.budget)


def _print_quality(engine_dir: str) -> None:
    """The KV cache's bytes per token, the build's size (bits per weight, bytes against a bfloat16
    engine) and a quantized build's held-out figures, from its build report."""
    import json
    from tritium.builder.report import activation_line, kv_cache_line, quality_summary, size_summary
    path = os.path.join(engine_dir, BUILD_REPORT_FILE)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            report = json.load(f)
        lines = (([kv_cache_line(report["kv_cache"])] if "kv_cache" in report else []) + size_summary(report)
                 + [line for line in [activation_line(report)] if line] + quality_summary(report))
        for line in lines:
            print(line, file=sys.stderr)


def _budget_status(budget: dict) -> int:
    """--quantization auto: print the per-format counts and the measured result; 3 if over budget."""
    if not budget:
        return 0
    counts = ", ".join(f"{n} {k}" for k, n in budget["choices"].items())
    line = (f"perplexity increase {budget['measured_ppl_increase_pct']:+.3f}% on {budget['held_out_tokens']} "
            f"held-out tokens, budget {budget['max_ppl_increase_pct']}%")
    if budget["met"]:
        print(f"auto: {counts}; {line}: met", file=sys.stderr)
        return 0
    print(f"tritium build: error: --max-ppl-increase {budget['max_ppl_increase_pct']} cannot be met: the most precise "
          f"allowed assignment ({counts}) measures {line}; the engine was written for inspection "
          f"(build_report.json lists every layer)", file=sys.stderr)
    return 3
