"""EngineConfig: the one typed config the builder writes and the runtime reads back.

An engine directory holds `engine.json` (this dataclass as JSON), `rank{r}.safetensors`,
tokenizer files and `build_report.json`. Nothing is parsed from file names.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from .config_moe import SUPPORTED_ROUTER_SCORING, SUPPORTED_ROUTER_TOPK, validate_mla, validate_moe, validate_routing  # noqa: F401
from .parallel_layout import TensorParallelError, layout_from_config

# Bump when the on-disk layout changes; readers accept every version <= this one.
# 2: the model-family fields of ModelConfig / RopeConfig (all defaulted, so version-1 files of
#    Llama / Mistral / Qwen2 load unchanged; an older runtime refuses a version-2 file by number).
# 3: group scales / zeros of int8 / fp8 layers stored as float16 (bfloat16 past float16's range),
#    per-row int8 scales as bfloat16 where exact, and the embedding of int8 / fp8 builds stored
#    as int8 in groups of 32 (kernels/quant_layouts.py). Readers take any of float32 / float16 /
#    bfloat16 for these tensors, so version-1/2 engines (float32) load and compute unchanged.
ENGINE_FORMAT_VERSION = 3
ENGINE_CONFIG_FILE = "engine.json"
BUILD_REPORT_FILE = "build_report.json"

# One declaration each in backend/models/families.py (which checks that the two lists agree).
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "olmo2",
                           "granite", "smollm3", "mixtral", "qwen3_moe", "qwen2_moe", "olmoe",
                           "deepseek_v2", "deepseek_v3", "gpt_oss")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_tanh")
# Where a layer's RMSNorms sit: "pre" (Llama: before attention and before the MLP), "sandwich"
# (Gemma 2/3: before and after each), "post" (OLMo 2: after each, none before).
SUPPORTED_NORM_PLACEMENTS = ("pre", "sandwich", "post")
# q/k RMSNorm after the projections: "head" (Qwen3, Gemma 3: per head over head_dim), "full"
# (OLMo 2: over the whole q and k projections).
SUPPORTED_QK_NORMS = ("none", "head", "full")
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
# "auto": per-layer choices under a quality budget (builder/quant/quant_auto.py); the runtime reads
# each linear's own entry in QuantConfig.layers, as for every method.
SUPPORTED_QUANTIZATION = ("none", "int8", "fp8", "int4-rtn", "int4-awq", "int4-gptq", "auto")
# quantization.method of an engine built from a pre-quantized checkpoint (builder/prequant/);
# not a --quantization choice: the source's own format is in quantization.imported.
IMPORTED_QUANTIZATION = "imported"
# `tritium build --embedding-quantization`: how a quantized build stores the embedding / LM head
# (builder/quant/quant_plan.py; "auto" depends on --quantization).
SUPPORTED_EMBEDDING_QUANTIZATION = ("auto", "int8", "int6", "int4", "none")
SUPPORTED_KV_CACHE_DTYPES = ("auto", "fp8", "int8")
SUPPORTED_KV_ROTATIONS = ("none", "hadamard")


class EngineFormatError(ValueError):
    """An engine directory that this runtime cannot read; the message names the file/field."""


@dataclass(frozen=True)
class RopeConfig:
    """One rotary embedding (backend/models/rope.py computes its table)."""
    theta: float = 10000.0
    scaling_type: str = "default"  # one of SUPPORTED_ROPE_TYPES
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: Optional[int] = None  # llama3, yarn, longrope
    # yarn: ramp bounds (in rotations) and the attention factor (None = from factor / mscale)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: Optional[float] = None
    mscale_all_dim: Optional[float] = None
    truncate: bool = True
    attention_factor: Optional[float] = None  # yarn, longrope
    # longrope: per-frequency rescale factors (rotary_dim // 2 each)
    short_factor: tuple = ()
    long_factor: tuple = ()


def _rope_from_dict(r: dict) -> RopeConfig:
    r = dict(r)
    for key in ("short_factor", "long_factor"):
        r[key] = tuple(r.get(key, ()))
    return RopeConfig(**r)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig = field(default_factory=RopeConfig)
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    tie_word_embeddings: bool = False
    # Per-layer sliding window in tokens; None = full attention for that layer.
    sliding_windows: tuple = ()
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple = ()
    pad_token_id: Optional[int] = None
    # ---- what the families beyond Llama change (defaults are Llama's) -----------------------
    activation: str = "silu"  # gated MLP activation, one of SUPPORTED_ACTIVATIONS
    norm_placement: str = "pre"  # one of SUPPORTED_NORM_PLACEMENTS
    qk_norm: str = "none"  # one of SUPPORTED_QK_NORMS
    o_proj_bias: bool = False  # o_proj carries a bias (Gemma 3 / Granite with attention_bias)
    mlp_bias: bool = False  # gate_up_proj and down_proj carry biases (Granite, SmolLM3 mlp_bias)
    attention_scale: Optional[float] = None  # softmax scale; None = head_dim ** -0.5
    attn_logit_softcap: Optional[float] = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcap: Optional[float] = None  # logits -> cap * tanh(logits / cap) (Gemma 2/3)
    embedding_multiplier: float = 1.0  # embeddings times this, rounded to the dtype (Gemma, Granite)
    residual_multiplier: float = 1.0  # attention / MLP outputs times this before the residual add
    logits_scaling: float = 1.0  # logits divided by this (Granite)
    rotary_dim: Optional[int] = None  # RoPE on the first rotary_dim channels of a head; None = all
    # Sliding-window layers rotate with this rope instead of `rope` (Gemma 3's local base).
    rope_local: Optional[RopeConfig] = None
    nope_layers: tuple = ()  # layers without RoPE (SmolLM3's no_rope_layers)
    # ---- mixture of experts (backend/models/moe.py); num_experts 0 = a dense model ----------
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k
    moe_intermediate_size: int = 0  # each expert's intermediate size (dense layers: intermediate_size)
    router_scoring: str = "softmax"  # one of SUPPORTED_ROUTER_SCORING
    norm_topk_prob: bool = False  # the k chosen probabilities renormalized to sum to one
    shared_expert_intermediate_size: int = 0  # 0 = no shared expert (Qwen2-MoE has one)
    shared_expert_gate: bool = False  # shared expert output times sigmoid(x . w) (Qwen2-MoE)
    dense_layers: tuple = ()  # layers that keep the dense MLP (mlp_only_layers, decoder_sparse_step)
    # DeepSeek routing (models/moe_routing.py): router_topk one of SUPPORTED_ROUTER_TOPK; the
    # correction bias is the engine tensor layers.{i}.router.correction_bias.
    router_topk: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    router_correction_bias: bool = False
    kv_lora_rank: int = 0  # multi-head latent attention (models/mla.py, config_moe.py); 0 = none
    q_lora_rank: int = 0  # 0: q_proj straight from the hidden state (DeepSeek-V2-Lite)
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # ---- gpt-oss (families/gpt_oss.py) -------------------------------------------------------
    attention_sinks: bool = False  # a learned logit per query head joins each softmax (layers.{i}.sinks)
    router_bias: bool = False  # the router linear has a bias
    # Router order: False = softmax over all experts then top-k; True = top-k of the logits, then
    # a softmax over those k (gpt-oss).
    router_topk_then_softmax: bool = False
    expert_bias: bool = False  # each expert's gate_up and down projections carry biases
    # Experts' clamped SwiGLU (gpt-oss): gate <= limit, -limit <= up <= limit,
    # out = (up + 1) * gate * sigmoid(alpha * gate); None = the plain `activation`.
    swiglu_limit: Optional[float] = None
    swiglu_alpha: float = 1.702

    def window(self, layer: int) -> Optional[int]:
        return self.sliding_windows[layer] if self.sliding_windows else None

    def rope_kind(self, layer: int) -> Optional[str]:
        """Which rotary table layer `layer` uses: "global", "local" or None (no RoPE)."""
        if layer in self.nope_layers:
            return None
        return "local" if self.rope_local is not None and self.window(layer) is not None else "global"

    def sparse(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a mixture of experts."""
        return self.num_experts > 0 and layer not in self.dense_layers


@dataclass(frozen=True)
class LayerQuant:
    """How one linear layer is stored; see QuantConfig.layouts for the packing."""
    method: str  # "none" | "int8" | "fp8" | "int4" | "int6" (embedding / LM head only)
    # int4: always set. int8 / fp8: None = one scale per output channel; set = group-wise scales
    # (K // group_size, N) (kernels/quant_layouts.py, the grouped layouts).
    group_size: Optional[int] = None
    act_order: bool = False  # int4: a g_idx tensor is stored (GPTQ act-order with dynamic groups)
    # Why this group size, e.g. "source Q4_1 blocks of 32" or "128 does not divide 576 -> 64".
    group_reason: Optional[str] = None
    # GPTQ only (provenance; the runtime ignores it): columns were processed in act-order with
    # group params fixed per original column block, so no g_idx is needed.
    static_groups: bool = False
    # embed_tokens only: the stored int8 rows are W * s (AWQ's scales on the tied LM head, whose
    # 1 / s is folded into norm.weight); the lookup divides by s (engine tensor
    # embed_tokens.input_scale, float32 (hidden,)).
    input_scale: bool = False
    # The LM head (embed_tokens when tied, else lm_head) only: a centred head. Its GEMM runs on
    # x - head_input_mean (float32 (hidden,)) and head_mean_logits (float32 (vocab,), the mean
    # input's logits from the float weights) is added to its output (int4-awq; builder/quant/quant_head.py).
    centred: bool = False
    # int8 / fp8 with group_size only: a zeros tensor (K // group_size, N) is stored beside
    # the scales (asymmetric groups, chosen per group to keep a block-quantized source's grid).
    asymmetric: bool = False
    symmetric: bool = False  # int4 only: no zeros tensor, w = (q - 8) * scale (Q4_0's grid, quant_layouts.py)


@dataclass(frozen=True)
class QuantConfig:
    method: str = "none"  # one of SUPPORTED_QUANTIZATION
    group_size: Optional[int] = None  # requested default group size (int4 only)
    # Per-linear choices, keyed by module name, e.g. "layers.3.qkv_proj".
    layers: dict = field(default_factory=dict)
    # Packing layouts keyed by LayerQuant.method: free text documenting tensor names/dtypes.
    layouts: dict = field(default_factory=dict)
    calibration: dict = field(default_factory=dict)  # provenance: text source, samples, hash
    # method "imported": the source checkpoint's format, e.g. {"format": "gptq", "bits": 4,
    # "group_size": 128, "desc_act": true, "sym": false, "checkpoint_format": "gptq"}
    imported: dict = field(default_factory=dict)
    # --quantization auto only (provenance): the budget, the measured perplexity increase on the
    # held-out slice, whether it was met, and how many linears took each format.
    budget: dict = field(default_factory=dict)
    smoothquant: dict = field(default_factory=dict)  # provenance: SmoothQuant's alpha, linears smoothed


def _quant_config_from_dict(q: dict) -> QuantConfig:
    """QuantConfig from JSON: per-layer entries become LayerQuant again (make_linear reads them)."""
    q = dict(q)
    q["layers"] = {name: LayerQuant(**lq) if isinstance(lq, dict) else lq
                   for name, lq in q.get("layers", {}).items()}
    return QuantConfig(**q)


@dataclass(frozen=True)
class KVCacheConfig:
    dtype: str = "auto"  # "auto" = the engine dtype; "fp8" (E4M3) or "int8" with per-head scales
    # "hadamard": K (after RoPE and k_offset) and V stored times the normalized Hadamard matrix
    # of order head_dim, the query rotated alike, the output rotated back (models/kv_rotation.py).
    rotation: str = "none"
    # Quantized: per-layer, per-KV-head layers.{i}.k_scale / v_scale (float32 (num_kv_heads,)),
    # optionally k_offset / v_offset (float32 (num_kv_heads, head_dim)) subtracted from K (after
    # RoPE) / V before they are stored (softmax ignores the shift; v_offset is added back).


@dataclass(frozen=True)
class Limits:
    max_batch_size: int = 64
    max_seq_len: int = 2048
    block_size: int = 16


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    dtype: str = "float32"
    quantization: QuantConfig = field(default_factory=QuantConfig)
    kv_cache: KVCacheConfig = field(default_factory=KVCacheConfig)
    limits: Limits = field(default_factory=Limits)
    tensor_parallel_size: int = 1
    # Which heads / features / vocabulary rows each rank holds (backend/parallel_layout.py);
    # empty when tensor_parallel_size is 1. Rank r's weights are rank{r}.safetensors.
    tensor_parallel: dict = field(default_factory=dict)
    build: dict = field(default_factory=dict)  # provenance: source, sha256, tool version, time
    format_version: int = ENGINE_FORMAT_VERSION
    # Batch-invariant kernels everywhere, also where a fast library path would not be (oneDNN's
    # bf16 GEMMs on CPU): `tritium build --deterministic`, or the backend parameter
    # `deterministic` (docs/determinism.md).
    deterministic: bool = False
    activation_quant: str = "none"  # "int8": W8A8 / W4A8 integer-dot linears on CPU (docs/quantization.md)

    # ---- JSON round trip -------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> "EngineConfig":
        if not isinstance(d, dict):
            raise EngineFormatError(f"{ENGINE_CONFIG_FILE}: expected a JSON object")
        version = d.get("format_version")
        if not isinstance(version, int):
            raise EngineFormatError(f"{ENGINE_CONFIG_FILE}: field 'format_version' missing or not an int")
        if version > ENGINE_FORMAT_VERSION:
            raise EngineFormatError(
                f"{ENGINE_CONFIG_FILE}: format_version {version} is newer than this runtime supports "
                f"(<= {ENGINE_FORMAT_VERSION}); upgrade tritium or rebuild the engine")
        try:
            m = dict(d["model"])
            m["rope"] = _rope_from_dict(m.get("rope", {}))
            if m.get("rope_local") is not None:
                m["rope_local"] = _rope_from_dict(m["rope_local"])
            m["nope_layers"] = tuple(m.get("nope_layers", ()))
            m["dense_layers"] = tuple(m.get("dense_layers", ()))
            m["sliding_windows"] = tuple(m.get("sliding_windows", ()))
            m["eos_token_ids"] = tuple(m.get("eos_token_ids", ()))
            model = ModelConfig(**m)
            cfg = cls(
                model=model,
                dtype=d.get("dtype", "float32"),
                quantization=_quant_config_from_dict(d.get("quantization", {})),
                kv_cache=KVCacheConfig(**d.get("kv_cache", {})),
                limits=Limits(**d.get("limits", {})),
                tensor_parallel_size=d.get("tensor_parallel_size", 1),
                tensor_parallel=d.get("tensor_parallel", {}),
                build=d.get("build", {}),
                format_version=version,
                deterministic=d.get("deterministic", False),
                activation_quant=d.get("activation_quant", "none"),
            )
        except KeyError as e:
            raise EngineFormatError(f"{ENGINE_CONFIG_FILE}: missing field {e}") from None
        except TypeError as e:
            raise EngineFormatError(f"{ENGINE_CONFIG_FILE}: {e}") from None
        cfg.validate()
        return cfg

    def validate(self) -> None:
        m = self.model
        if not isinstance(self.deterministic, bool):
            raise EngineFormatError(f"deterministic must be true or false, got {self.deterministic!r}")
        if self.activation_quant not in ("none", "int8"):  # weight-only, or W8A8 / W4A8 on CPU
            raise EngineFormatError(f"activation_quant must be none or int8, got {self.activation_quant!r}")
        if m.architecture not in SUPPORTED_ARCHITECTURES:
            raise EngineFormatError(
                f"model.architecture {m.architecture!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if self.dtype not in SUPPORTED_DTYPES:
            raise EngineFormatError(f"dtype {self.dtype!r} not in {SUPPORTED_DTYPES}")
        if self.quantization.method not in SUPPORTED_QUANTIZATION + (IMPORTED_QUANTIZATION,):
            raise EngineFormatError(
                f"quantization.method {self.quantization.method!r} not in "
                f"{SUPPORTED_QUANTIZATION + (IMPORTED_QUANTIZATION,)}")
        if self.kv_cache.dtype not in SUPPORTED_KV_CACHE_DTYPES:
            raise EngineFormatError(f"kv_cache.dtype {self.kv_cache.dtype!r} not in {SUPPORTED_KV_CACHE_DTYPES}")
        if self.kv_cache.rotation not in SUPPORTED_KV_ROTATIONS:
            raise EngineFormatError(f"kv_cache.rotation {self.kv_cache.rotation!r} not in {SUPPORTED_KV_ROTATIONS}")
        hd = self.model.head_dim
        if self.kv_cache.rotation == "hadamard" and (hd <= 0 or hd & (hd - 1)):
            raise EngineFormatError(f"kv_cache.rotation 'hadamard' needs model.head_dim a power of two, got {hd}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if getattr(m, name) <= 0:
                raise EngineFormatError(f"model.{name} must be > 0, got {getattr(m, name)}")
        if m.num_heads % m.num_kv_heads:
            raise EngineFormatError(
                f"model.num_heads ({m.num_heads}) must be a multiple of model.num_kv_heads ({m.num_kv_heads})")
        if m.sliding_windows and len(m.sliding_windows) != m.num_layers:
            raise EngineFormatError("model.sliding_windows must have one entry per layer")
        for name, value, allowed in (("activation", m.activation, SUPPORTED_ACTIVATIONS),
                                     ("norm_placement", m.norm_placement, SUPPORTED_NORM_PLACEMENTS),
                                     ("qk_norm", m.qk_norm, SUPPORTED_QK_NORMS),
                                     ("rope.scaling_type", m.rope.scaling_type, SUPPORTED_ROPE_TYPES)):
            if value not in allowed:
                raise EngineFormatError(f"model.{name} {value!r} is not supported; supported: {', '.join(allowed)}")
        if m.rope_local is not None and m.rope_local.scaling_type not in SUPPORTED_ROPE_TYPES:
            raise EngineFormatError(f"model.rope_local.scaling_type {m.rope_local.scaling_type!r} is not supported; "
                                    f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        bad = [i for i in m.nope_layers if not 0 <= i < m.num_layers]
        if bad:
            raise EngineFormatError(f"model.nope_layers entry {bad[0]} is not a layer index (0..{m.num_layers - 1})")
        validate_moe(self, EngineFormatError)
        validate_mla(m, self.kv_cache, EngineFormatError)
        if m.rotary_dim is not None and not (0 < m.rotary_dim <= m.head_dim and m.rotary_dim % 2 == 0):
            raise EngineFormatError(f"model.rotary_dim {m.rotary_dim} must be even and in (0, head_dim {m.head_dim}]")
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise EngineFormatError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
        if tp > 1:
            try:
                layout_from_config(self)
            except TensorParallelError as e:
                raise EngineFormatError(str(e)) from None
        lim = self.limits
        for name in ("max_batch_size", "max_seq_len", "block_size"):
            if getattr(lim, name) <= 0:
                raise EngineFormatError(f"limits.{name} must be > 0")

    # ---- files -------------------------------------------------------------------------
    def save(self, engine_dir: str) -> None:
        with open(os.path.join(engine_dir, ENGINE_CONFIG_FILE), "w") as f:
            f.write(self.to_json() + "\n")

    @classmethod
    def load(cls, engine_dir: str) -> "EngineConfig":
        path = os.path.join(engine_dir, ENGINE_CONFIG_FILE)
        if not os.path.isdir(engine_dir):
            raise EngineFormatError(f"{engine_dir}: engine directory does not exist")
        if not os.path.isfile(path):
            raise EngineFormatError(f"{path}: missing engine config (is this an engine directory?)")
        try:
            with open(path) as f:
                data: Any = json.load(f)
        except json.JSONDecodeError as e:
            raise EngineFormatError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
        return cls.from_dict(data)

    def weights_file(self, rank: int = 0) -> str:
        return f"rank{rank}.safetensors"


def with_deterministic(cfg: "EngineConfig", deterministic: Optional[bool]) -> "EngineConfig":
    """cfg with the `deterministic` option overridden (None: the engine's own setting)."""
    if deterministic is None or deterministic == cfg.deterministic:
        return cfg
    if not isinstance(deterministic, bool):
        raise ValueError(f"deterministic must be true or false, got {deterministic!r}")
    if cfg.tensor_parallel_size > 1:
        raise ValueError("deterministic: a tensor-parallel engine takes it from its build "
                         "(tritium build --deterministic), not as a runtime override")
    return dataclasses.replace(cfg, deterministic=deterministic)
