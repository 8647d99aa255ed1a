"""Engine options: declared once, read from a command line or from config.pbtxt parameters.

`tritium build --repo` writes some of them into the served model's config.pbtxt, `tritium
generate --engine` takes some as flags, and the Triton backend reads them back from the model's
parameters: all three go through this table and `engine_setup`, so a flag, its parameter key,
its type, range and default are written once. `--lora NAME=PATH` (repeatable) is the command
line's spelling of lora_adapters for both commands (add_lora_arguments, lora_adapters_from_args).

    opts = options_from_args(args, ("num_kv_blocks", "speculative_method", ...))   # CLI
    opts = options_from_params(model_config_parameters)                           # config.pbtxt
    setup = engine_setup(opts, model_dir)   # LLMEngine kwargs + SpeculativeConfig + ThreadPolicy
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import Dict, Iterable, Optional

from .decode_burst import DEFAULT_MAX_DECODE_BURST, MAX_DECODE_BURST
from .device_step import DeviceStepOptions
from .lora.adapter import DEFAULT_MAX_LORA_RANK
from .lora.manager import DEFAULT_MAX_LORAS, LoRAConfig, parse_adapter_list
from .speculative.config import DEFAULT_NUM_SPECULATIVE_TOKENS, MAX_SPECULATIVE_TOKENS, METHODS, SpeculativeConfig
from .thread_policy import ThreadPolicy

DEFAULT_MAX_QUEUE_SIZE = 1024  # requests waiting for their first step; more are refused as overloaded


@dataclass(frozen=True)
class EngineOption:
    name: str                   # config.pbtxt parameter key, and the options dict's key
    kind: str                   # "int", "float", "bool", "str" or "path" (relative to the model folder in config.pbtxt)
    cli: str                    # command-line flag
    help: str
    lo: Optional[int] = 1       # "int": smallest value
    hi: Optional[int] = None
    choices: Optional[tuple] = None
    metavar: Optional[str] = None  # the flag's value in --help (default: N, F, DIR or VALUE by kind)

    def parse(self, value, where: str):
        """A flag's or a parameter's value -> its Python value; ValueError names `where`."""
        if value is None or (isinstance(value, str) and not value.strip()):
            return None
        if self.kind == "int":
            try:
                v = int(str(value).strip())
            except ValueError:
                raise ValueError(f"{where} must be an integer, got {value!r}") from None
            if (self.lo is not None and v < self.lo) or (self.hi is not None and v > self.hi):
                raise ValueError(f"{where} must be an integer in [{self.lo}, {self.hi if self.hi else 'inf'}], "
                                 f"got {v}")
            return v
        if self.kind == "float":
            try:
                v = float(str(value).strip())
            except ValueError:
                v = None
            if v is None or not ((self.lo is None or v > self.lo) and (self.hi is None or v <= self.hi)):
                raise ValueError(f"{where} must be a number in ({self.lo}, {self.hi}], got {value!r}")
            return v
        if self.kind == "bool":
            if isinstance(value, bool):
                return value
            v = str(value).strip().lower()
            if v not in ("true", "false", "1", "0"):
                raise ValueError(f"{where} must be true or false, got {value!r}")
            return v in ("true", "1")
        v = str(value).strip()
        if self.choices is not None and v.lower() not in self.choices:
            raise ValueError(f"{where} must be one of {', '.join(self.choices)}, got {value!r}")
        return v.lower() if self.choices is not None else v


OPTIONS = (
    EngineOption("num_kv_blocks", "int", "--num-kv-blocks", "KV cache blocks (default: sized from memory)"),
    EngineOption("max_num_seqs", "int", "--max-num-seqs", "max sequences per step (default: engine max batch)"),
    EngineOption("max_num_batched_tokens", "int", "--max-num-batched-tokens", "token budget per step (default 2048)"),
    EngineOption("enable_prefix_caching", "bool", "--enable-prefix-caching",
                 "reuse cached prompt blocks (default true)"),
    EngineOption("device", "str", "--device", "cpu or cuda (default: cuda if available)"),
    EngineOption("gpu_memory_utilization", "float", "--gpu-memory-utilization",
                 "fraction of each GPU's memory the instances on it share for weights and KV cache "
                 "(default 0.85; docs/serving.md#placement)", lo=0, hi=1),
    EngineOption("deterministic", "bool", "--deterministic",
                 "batch-invariant numerics (docs/determinism.md; default: the engine's own setting)"),
    EngineOption("activation_quant", "str", "--activation-quant",
                 "int8: int8 / int4 linears quantize activations per 32-block and use integer dot products on "
                 "CPU (W8A8 / W4A8); none: weight-only numerics (default: the engine's own setting; "
                 "docs/quantization.md)", choices=("none", "int8")),
    EngineOption("device_sampling", "bool", "--device-sampling",
                 "sample on the model's device, only token ids and logprobs copied back (default: true on "
                 "CUDA, false on CPU; docs/serving.md#the-device-step)"),
    EngineOption("cuda_graphs", "bool", "--cuda-graphs",
                 "decode steps on static buffers per batch bucket, captured as CUDA graphs at load (default: "
                 "true on CUDA, false on CPU, where true runs the same buffers eagerly)"),
    EngineOption("max_decode_burst", "int", "--max-decode-burst",
                 f"greedy decode steps one native call may run for a decode-only batch of plain greedy rows when "
                 f"nothing waits (default {DEFAULT_MAX_DECODE_BURST}; 1: off; TRITIUM_DECODE_BURST overrides it; "
                 f"docs/serving.md#decode-bursts)", hi=MAX_DECODE_BURST),
    EngineOption("max_queue_size", "int", "--max-queue-size",
                 f"waiting requests beyond which new ones fail as overloaded "
                 f"(server default {DEFAULT_MAX_QUEUE_SIZE})"),
    EngineOption("num_threads", "int", "--num-threads", "torch intra-op threads (default: every core)"),
    EngineOption("small_step_threads", "int", "--small-step-threads",
                 "threads for steps of fewer than 4 tokens (default: measured while serving, one or num_threads, "
                 "whichever is faster at the time; see ThreadPolicy)"),
    EngineOption("threads_per_rank", "int", "--threads-per-rank",
                 "threads of each tensor-parallel worker (default: the cores divided by the ranks)"),
    EngineOption("speculative_method", "str", "--speculative",
                 "speculative decoding: ngram (prompt lookup) or draft (a draft engine proposes); greedy output is "
                 "the same as without, sampled output has the same distribution", choices=METHODS),
    EngineOption("draft_engine_dir", "path", "--draft-engine",
                 "draft engine for --speculative draft (same tokenizer, e.g. an int4 build of the model)"),
    EngineOption("num_speculative_tokens", "int", "--num-speculative-tokens",
                 f"tokens proposed per step (default {DEFAULT_NUM_SPECULATIVE_TOKENS})", hi=MAX_SPECULATIVE_TOKENS),
    # LoRA adapters (docs/lora.md). `tritium build --repo --lora NAME=PATH` writes lora_adapters.
    EngineOption("lora_adapters", "str", "--lora-adapters",
                 "NAME=PATH,NAME2=PATH2: PEFT LoRA folders served by name (relative to the model folder in "
                 "config.pbtxt)"),
    EngineOption("max_loras", "int", "--max-loras",
                 f"LoRA adapters in device memory, and at most in one step (default {DEFAULT_MAX_LORAS})"),
    EngineOption("max_cpu_loras", "int", "--max-cpu-loras",
                 "LoRA adapters cached in host memory (default: max(max_loras, the adapters listed))"),
    EngineOption("max_lora_rank", "int", "--max-lora-rank",
                 f"largest LoRA adapter rank per module (default {DEFAULT_MAX_LORA_RANK})", metavar="R"),
    EngineOption("enable_lora", "bool", "--enable-lora",
                 "serve adapters sent with requests (lora_task_id) even without lora_adapters"),
)
OPTION = {o.name: o for o in OPTIONS}
SPECULATIVE = ("speculative_method", "draft_engine_dir", "num_speculative_tokens")
LORA = ("lora_adapters", "max_loras", "max_cpu_loras", "max_lora_rank", "enable_lora")
# The command line's spelling of lora_adapters (`tritium build --repo`, `tritium generate --engine`):
# one repeatable flag per adapter, joined into lora_adapters by lora_adapters_from_args.
LORA_FLAG = "--lora"
LORA_FLAG_HELP = ("a PEFT LoRA folder (adapter_config.json + adapter_model.safetensors) served as adapter NAME "
                  "(repeatable); requests pick it by name (docs/lora.md)")


def add_option_arguments(p, names: Iterable[str], title: str, group=None):
    """Flags for the named options (dest: the option name; absent: None), in a new argument group
    (or `group`); returns the group."""
    g = group if group is not None else p.add_argument_group(title)
    for name in names:
        o = OPTION[name]
        kw = {"choices": o.choices} if o.choices else {}
        metavar = None if o.choices else o.metavar or ("N" if o.kind == "int" else "F" if o.kind == "float"
                                                       else "DIR" if o.kind == "path" else "VALUE")
        g.add_argument(o.cli, dest=o.name, default=None, metavar=metavar, help=o.help, **kw)
    return g


def add_lora_arguments(p, limits: Iterable[str], title: str) -> None:
    """`--lora NAME=PATH` (repeatable, dest "lora") and the named LoRA limit options' flags."""
    g = p.add_argument_group(title)
    g.add_argument(LORA_FLAG, dest="lora", action="append", default=[], metavar="NAME=PATH", help=LORA_FLAG_HELP)
    add_option_arguments(p, limits, title, group=g)


def lora_adapters_from_args(args: argparse.Namespace) -> Dict[str, str]:
    """{name: path} of the --lora NAME=PATH flags, in order (errors name the flag)."""
    from .lora.adapter import parse_lora_spec
    out = {}
    for spec in getattr(args, "lora", None) or []:
        name, path = parse_lora_spec(spec)
        if name in out:
            raise ValueError(f"{LORA_FLAG}: adapter {name!r} is given twice")
        if "," in path:
            raise ValueError(f"{LORA_FLAG} {name}: the path must not contain ',' (lora_adapters separates entries "
                             f"with it)")
        out[name] = path
    return out


def options_from_args(args: argparse.Namespace, names: Iterable[str]) -> Dict[str, object]:
    """{name: value} of the named options given on the command line (errors name the flag)."""
    out = {}
    for name in names:
        v = OPTION[name].parse(getattr(args, name, None), OPTION[name].cli)
        if v is not None:
            out[name] = v
    return out


def options_from_params(params: Dict[str, str]) -> Dict[str, object]:
    """{name: value} of the options a config.pbtxt's parameters set (errors name the parameter)."""
    out = {}
    for o in OPTIONS:
        v = o.parse(params.get(o.name), f"parameter {o.name}")
        if v is not None:
            out[o.name] = v
    return out


def to_params(opts: Dict[str, object]) -> Dict[str, str]:
    """Options -> config.pbtxt parameter strings (what options_from_params reads back)."""
    return {k: (str(v).lower() if isinstance(v, bool) else str(v)) for k, v in opts.items() if v is not None}


def speculative_config(opts: Dict[str, object], base_dir: Optional[str] = None) -> Optional[SpeculativeConfig]:
    """The speculative options -> a checked SpeculativeConfig, or None when speculation is off.
    A relative draft_engine_dir is taken relative to base_dir (a model folder) when given."""
    method, draft, k = (opts.get(n) for n in SPECULATIVE)
    if method is None:
        if draft is not None or k is not None:
            raise ValueError(f"{OPTION['draft_engine_dir'].cli} / {OPTION['num_speculative_tokens'].cli} "
                             f"(parameters draft_engine_dir / num_speculative_tokens) need "
                             f"{OPTION['speculative_method'].cli} ngram|draft (parameter speculative_method)")
        return None
    if draft is not None:
        draft = os.path.expanduser(draft)
        if base_dir is not None and not os.path.isabs(draft):
            draft = os.path.normpath(os.path.join(base_dir, draft))
    return SpeculativeConfig(method, num_speculative_tokens=DEFAULT_NUM_SPECULATIVE_TOKENS if k is None else k,
                             draft_engine_dir=draft).validate()


def _resolve(path: str, base_dir: Optional[str]) -> str:
    path = os.path.expanduser(path)
    return path if base_dir is None or os.path.isabs(path) else os.path.normpath(os.path.join(base_dir, path))


def lora_config(opts: Dict[str, object], base_dir: Optional[str] = None) -> Optional[LoRAConfig]:
    """The LoRA options -> a checked LoRAConfig, or None when the engine serves no adapters (no
    lora_adapters, enable_lora not true). Relative adapter paths are taken relative to base_dir."""
    where = f"{OPTION['lora_adapters'].cli} (parameter lora_adapters)"
    adapters = {n: _resolve(p, base_dir) for n, p in parse_adapter_list(opts.get("lora_adapters") or "", where).items()}
    if not adapters and not opts.get("enable_lora"):
        return None
    return LoRAConfig(adapters, max_loras=opts.get("max_loras") or DEFAULT_MAX_LORAS,
                      max_cpu_loras=opts.get("max_cpu_loras"),
                      max_lora_rank=opts.get("max_lora_rank") or DEFAULT_MAX_LORA_RANK).validate()


@dataclass
class EngineSetup:
    """What the options mean for an engine: LLMEngine keyword arguments (speculative and lora included),
    the thread policy, and AsyncLLMEngine's max_queue_size."""
    engine_kwargs: Dict[str, object] = field(default_factory=dict)
    thread_policy: Optional[ThreadPolicy] = None
    max_queue_size: Optional[int] = None


def engine_setup(opts: Dict[str, object], base_dir: Optional[str] = None, tp_size: int = 1,
                 server: bool = False) -> EngineSetup:
    """Options -> EngineSetup. server: the Triton backend's defaults (a thread policy that measures
    whether small steps run faster on one thread or all, a bounded queue); otherwise torch's thread count stays as it is."""
    kw = {k: opts[k] for k in ("num_kv_blocks", "max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching",
                               "device", "threads_per_rank", "deterministic", "gpu_memory_utilization",
                               "activation_quant", "max_decode_burst")
          if k in opts}
    if "device_sampling" in opts or "cuda_graphs" in opts:
        kw["device_step"] = DeviceStepOptions(device_sampling=opts.get("device_sampling"),
                                              cuda_graphs=opts.get("cuda_graphs"))
    spec = speculative_config(opts, base_dir)
    if spec is not None:
        kw["speculative"] = spec
    lora = lora_config(opts, base_dir)
    if lora is not None:
        kw["lora"] = lora
    policy = None
    cores = os.cpu_count() or 1
    per_rank = max(1, cores // tp_size)
    if tp_size > 1:
        kw.setdefault("threads_per_rank", per_rank)
    if server or "num_threads" in opts or "small_step_threads" in opts:
        threads = opts.get("num_threads", per_rank if tp_size > 1 else cores)
        policy = ThreadPolicy(threads, opts.get("small_step_threads"))
    queue = opts.get("max_queue_size", DEFAULT_MAX_QUEUE_SIZE if server else None)
    return EngineSetup(kw, policy, queue)
