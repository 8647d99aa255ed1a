"""Which steps run as one native call (kernels/decode_step.py, kernels/decode_layer.py), and the call.

A decode step of a small model is a few rows through 30 layers of a dozen ops each; through
Python each op costs about as much dispatch as arithmetic. For steps of at most
NATIVE_STEP_MAX_ROWS rows of a Llama-shaped bfloat16 model on CPU, DecoderLM.forward hands the
whole step to kernels/cpu_decode_step.c: the embedding lookup (int8 / int6 codes dequantized in
C), the rotary rows, the layer loop (kernels/cpu_decode_layer.c, the same native kernels in the
same order as the per-op path), the final norm and, through DecoderLM.decode_logits when every
row needs logits, the LM head and each row's argmax: the same bits (batch invariance included),
a fraction of the overhead.

What a model needs (docs/kernels.md has the table): bfloat16 engine with the native kernels,
one rank, dense (no experts) layers with pre-norms, SiLU gated MLP, no q/k norm, no soft-cap,
full RoPE on every layer, one sliding window (or none) for all layers, a plain bfloat16 KV cache, and every linear on a native kernel (cpu_linear kinds bf16_native,
int8_native, int8g_native, int4_native without act-order, i8dot); biases and Granite's multipliers are
fine. A step also needs at
most NATIVE_STEP_MAX_ROWS rows and no LoRA adapter in use. Otherwise the per-op path runs.
TRITIUM_NATIVE_STEP=0 turns the native call off. On several torch threads the call is one
parallel region (kernels/cpu_decode_layer.c); the bits do not depend on the thread count.
Building a model's NativeStep first moves the weights a decode step streams onto 2 MiB pages
(weights_to_huge_pages, kernels/hugepages.py; TRITIUM_HUGE_PAGES=0 leaves them where they are).
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from tritium.kernels import cpu_native, hugepages, ops
from tritium.kernels.decode_layer import DecodeLayers, linear_supported
from tritium.kernels.decode_step import DecodeStep, embedding_source, head_source

NATIVE_STEP_MAX_ROWS = 32
ENV = "TRITIUM_NATIVE_STEP"
_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


_parsed = (None, True)  # (the raw TRITIUM_NATIVE_STEP value last parsed, whether it means on)


def enabled() -> bool:
    """TRITIUM_NATIVE_STEP: unset or 1 on, 0 off; anything else is an error naming the values
    (read every step, parsed only when it changed)."""
    global _parsed
    raw = os.environ.get(ENV)
    if raw == _parsed[0]:
        return _parsed[1]
    v = (raw or "1").strip().lower()
    if v not in ("0", "1", "false", "true", "off", "on"):
        raise ValueError(f"{ENV}={raw!r}; allowed: 1 (default), 0")
    _parsed = (raw, v in ("1", "true", "on"))
    return _parsed[1]


def _packed(mod):
    """(CpuLinear or None, bias, LoRA manager or None) of a layer's linear module."""
    manager = getattr(mod, "_manager", None)
    if manager is not None:  # a LoRALinear (backend/lora/layer.py): its base runs when no adapter is in use
        mod = mod.base
    if hasattr(mod, "packed_weight"):  # DenseLinear
        return mod.packed_weight, mod.bias, manager
    if hasattr(mod, "_get_packed"):  # quantized linears (backend/quant.py)
        return (mod._get_packed() if mod.qweight.device.type == "cpu" else None), mod.bias, manager
    return None, None, manager


def refusal(model) -> Optional[str]:
    """None where `model` (a DecoderLM) can run its layers natively, else the first reason not."""
    cfg, m = model.cfg, model.cfg.model
    if cfg.dtype != "bfloat16":
        return f"engine dtype {cfg.dtype} (bfloat16 only)"
    if not cpu_native.available():
        return "native CPU kernels unavailable"
    if model.tp is not None:
        return "tensor parallelism"
    checks = [(m.num_experts, "mixture-of-experts layers"), (m.kv_lora_rank, "multi-head latent attention"),
              (m.attention_sinks, "attention sinks"), (m.norm_placement != "pre", f"norm placement {m.norm_placement}"),
              (m.qk_norm != "none", "q/k norms"), (m.attn_logit_softcap is not None, "attention soft-cap"),
              (m.activation != "silu", f"activation {m.activation}"),
              (m.hidden_size % 16 or m.head_dim % 32 or m.intermediate_size % 16, "hidden / head / MLP sizes "
               "not multiples of 16 / 32 / 16"),
              (m.num_heads > cpu_native.MAX_HEADS or m.num_heads * m.head_dim > cpu_native.MAX_HEADS_X_DIM
               or m.num_heads % m.num_kv_heads, "head counts beyond the attention kernel's")]
    for bad, why in checks:
        if bad:
            return why
    if len({layer.window for layer in model.layers}) != 1:
        return "sliding windows that differ between layers"
    for layer in model.layers:
        if layer.rope_kind != "global" or layer.rotary_dim != layer.head_dim:
            return "a layer without full global RoPE (NoPE, local or partial rotary)"
        if not layer.plain_kv:
            return "quantized, offset or rotated KV cache"
        for name in _LINEARS:
            p, _, _ = _packed(getattr(layer, name))
            why = linear_supported(p)
            if why is not None:
                return f"layers.{layer.idx}.{name}: {why}"
    return None


def _probe(model):
    """The module whose identity says the layers were not re-wrapped since the last check (None
    for layers without a fused qkv_proj, e.g. multi-head latent attention). Asked every step:
    the first layer through the ModuleList's dict (its indexing costs microseconds)."""
    layers = model.layers
    first = layers._modules.get("0") if isinstance(layers, torch.nn.ModuleList) else layers[0]
    return getattr(first, "qkv_proj", None)


def _streamed_weights(model) -> list:
    """What a decode step streams, as (holder, field) pairs, each tensor once: the fields of the
    integer-dot weights (kernels/i8dot_pack.I8DotWeight of the layers' linears, the LM head's
    I8DotWeight or head_pack.Head6Weight) and the bf16 weights packed for the native GEMM (the
    layers' and a tied head's packed copy; DenseLinear drops its own reference when it packs).
    A holder is an object whose attribute `field` is the tensor, or a CpuLinear and the index in
    its tensors. Weight-only int8 / int4 linears stay put: their packed tensors may share
    storage with the module's buffers, and a copy would double them."""
    out, seen = [], set()

    def add(p):
        if p is None or id(p) in seen:
            return
        seen.add(id(p))
        if p.kind in ("i8dot", "head6"):
            w = p.tensors[0]
            out.extend((w, f) for f in ("codes", "d", "z", "r") if getattr(w, f, None) is not None)
        elif p.kind == "bf16_native":
            out.append((p, 0))

    for layer in model.layers:
        for name in _LINEARS:
            add(_packed(getattr(layer, name))[0])
    head = model.lm_head if model.lm_head is not None else model.embed_tokens
    if head is not None and hasattr(head, "_get_packed") and head.qweight.device.type == "cpu":
        add(head._get_packed())
    elif head is not None and getattr(head, "packed_weight", None) is not None:
        add(head.packed_weight)
    add(getattr(model, "packed_head", None))
    return out


def _get(holder, field):
    return holder.tensors[field] if isinstance(field, int) else getattr(holder, field)


def _set(holder, field, value) -> None:
    if isinstance(field, int):
        holder.tensors = holder.tensors[:field] + (value,) + holder.tensors[field + 1:]
    else:
        setattr(holder, field, value)


def weights_to_huge_pages(model) -> int:
    """Moves the weights a decode step streams (_streamed_weights) into one buffer on 2 MiB pages
    (kernels/hugepages.py: one-row GEMVs read them up to about 1.5x faster there), swapping the
    views in place, so every path (native step, per-op, head, embedding lookup) reads the same
    values from the new place. Returns the bytes moved (0: nothing to move, or huge pages off or
    refused)."""
    fields = _streamed_weights(model)
    moved = hugepages.empty_views([(_get(h, f).shape, _get(h, f).dtype) for h, f in fields])
    if moved is None:
        return 0
    for (h, f), v in zip(fields, moved):  # one tensor at a time: the old one is freed as it is swapped out
        v.copy_(_get(h, f))
        _set(h, f, v)
    lib = cpu_native._lib()
    if lib is not None:
        lib.tritium_i8dot_huge_pages(1)
    return sum(v.numel() * v.element_size() for v in moved)


class NativeStep:
    """A DecoderLM's layers as one native call; `get(model)` builds it once per model (and moves
    the weights a step streams onto 2 MiB pages first: weights_to_huge_pages)."""

    def __init__(self, model):
        m = model.cfg.model
        self.huge_page_bytes = weights_to_huge_pages(model)
        layers, self.lora_managers = [], set()
        for layer in model.layers:
            lins = []
            for name in _LINEARS:
                p, bias, manager = _packed(getattr(layer, name))
                lins.append((p, bias))
                if manager is not None:
                    self.lora_managers.add(manager)
            layers.append((layer.input_norm_weight, layer.post_attn_norm_weight, lins))
        first = model.layers[0]
        self.window = first.window
        self.native = DecodeLayers(layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim,
                                   m.intermediate_size, m.rms_norm_eps, first.scale, m.residual_multiplier)
        self.step = DecodeStep(self.native, model.cos_sin_cache, model.norm_weight, m.embedding_multiplier)
        self._kv_key = self._emb_key = self._head_key = None

    @staticmethod
    def get(model) -> Optional["NativeStep"]:
        """The model's NativeStep, or None where refusal(model) names a reason (kept, so that is
        asked once; a model whose weights are not packed yet is asked again later)."""
        cached = model.__dict__.get("_native_step", False)
        # kept while the layers hold the same linear modules (LoRA's attach wraps them later)
        if cached is not False and model.__dict__.get("_native_step_probe") is _probe(model):
            return cached
        why = refusal(model)
        if why is not None and "not packed" in why:
            return None
        step = NativeStep(model) if why is None else None
        model.__dict__["_native_step"] = step
        model.__dict__["_native_step_probe"] = _probe(model)
        model.__dict__["native_step_refusal"] = why
        return step

    def takes(self, hidden: torch.Tensor, kv_caches, meta, rope) -> bool:
        """Whether this step may run natively (its rows, caches, rotary tables and adapters)."""
        tables = rope.tables.get("global")
        k0 = kv_caches[0][0]
        return (hidden.shape[0] <= NATIVE_STEP_MAX_ROWS and hidden.dtype == torch.bfloat16
                and hidden.device.type == "cpu" and tables is not None
                and k0.dtype == torch.bfloat16 and k0.is_contiguous() and meta.block_tables.dtype == torch.int32
                and all(mgr.batch is None for mgr in self.lora_managers) and enabled() and cpu_native.available())

    def run(self, hidden: torch.Tensor, kv_caches, meta, rope):
        """Every layer over the step's rows; returns (hidden, residual) as the layer loop would."""
        t, d = hidden.shape[0], kv_caches[0][0].shape[-1]
        cos, ssin = (c.reshape(t, d).contiguous() for c in rope.tables["global"])
        self.native.set_caches(kv_caches)
        plan = getattr(meta, "cpu_plan", None) or ops.attention_plan(meta)
        return self.native.run(hidden, None, cos, ssin, meta.slot_mapping.to(torch.int64).contiguous(),
                               plan.block_tables, plan.rows_for(meta, self.window), kv_caches[0][0].shape[1])

    @staticmethod
    def _member(obj, name: str):
        """getattr(obj, name, None) for an nn.Module without Module.__getattr__'s Python fallback
        (and an AttributeError for every absent name): the instance's dict, then its parameters,
        buffers and submodules, as Module.__getattr__ looks them up. These checks run every step."""
        if obj is None:
            return None
        d = obj.__dict__
        if name in d:
            return d[name]
        for store in ("_parameters", "_buffers", "_modules"):
            s = d.get(store)
            if s is not None and name in s:
                return s[name]
        return getattr(obj, name, None)

    def _set_embedding(self, model) -> bool:
        """Points the call's lookup at the model's embedding (again only when its tensors were
        swapped); whether the C lookup reads it."""
        get = NativeStep._member
        e = get(model, "embed_tokens")
        key = (get(model, "embed_tokens_weight"), e, get(e, "_panels"), get(e, "qweight"),
               get(model, "embed_input_scale"))
        if self._emb_key is None or any(a is not b for a, b in zip(key, self._emb_key)):
            self.step.set_embedding(embedding_source(model.embed_tokens_weight, model.embed_tokens),
                                    model.embed_input_scale)
            self._emb_key = key
        return self.step.front.kind != 0

    def _head_inputs(self, model) -> tuple:
        """Everything _packed() reads to find the head's packed weight: the model's head modules,
        the linear under a LoRA wrapper, its pack attributes and buffers (a load or .to() swaps
        those, and _get_packed repacks). Equal objects -> the same pack, without calling it."""
        get = NativeStep._member
        lm, emb = get(model, "lm_head"), get(model, "embed_tokens")
        if lm is None and emb is None:
            return (None, None, get(model, "packed_head"))
        mod = lm if lm is not None else emb
        if get(mod, "_manager") is not None:
            mod = get(mod, "base")
        d = mod.__dict__
        return (lm, emb, mod, d.get("packed_weight"), d.get("_packed"), d.get("_panels"),
                *d.get("_buffers", {}).values())

    def _set_head(self, model) -> bool:
        """Points the call's LM head at the model's (compute_logits' kernel, packed); whether the
        call runs it (not with Granite's logits scaling, a soft-cap, a bias or a LoRA head)."""
        inputs = self._head_inputs(model)
        last = self._head_key
        if last is not None and len(inputs) == len(last[2]) and all(a is b for a, b in zip(inputs, last[2])) \
                and (last[0] is None or last[0].tensors[0] is last[1]):
            return self.step.head is not None  # nothing it reads changed: the same pack
        m = model.cfg.model
        if model.lm_head is None and model.embed_tokens is None:
            p, bias, manager = model.packed_head, None, None
        else:
            p, bias, manager = _packed(model.lm_head if model.lm_head is not None else model.embed_tokens)
        key = (p, None if p is None else p.tensors[0])
        if last is None or any(a is not b for a, b in zip(key, last[:2])):
            ok = manager is None and m.logits_scaling == 1.0 and m.final_logit_softcap is None
            self.step.set_head(head_source(p, bias, model.head_input_mean, model.head_mean_logits) if ok else None)
        # after _packed: packing may swap the module's buffers (an integer-dot head keeps its codes in the panels)
        self._head_key = key + (self._head_inputs(model),)
        return self.step.head is not None

    def _ready(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta) -> bool:
        """Whether this step's tensors, caches and adapters let the native call run (and its
        caches are pointed at kv_caches)."""
        t = input_ids.shape[0]
        k0 = kv_caches[0][0]
        if not (t <= NATIVE_STEP_MAX_ROWS and input_ids.dtype == torch.int64 and positions.dtype == torch.int64
                and input_ids.is_contiguous() and positions.is_contiguous() and k0.dtype == torch.bfloat16
                and k0.is_contiguous() and meta.block_tables.dtype == torch.int32
                and all(mgr.batch is None for mgr in self.lora_managers) and enabled()):
            return False
        key = (id(kv_caches), k0.data_ptr(), kv_caches[-1][1].data_ptr())  # the runner's caches: one list
        if key != self._kv_key:
            self.native.set_caches(kv_caches)
            self._kv_key = key
        return True

    def can_burst(self, model) -> bool:
        """Whether the call runs this model's lookup and head itself (what a burst needs)."""
        return enabled() and self._set_head(model) and self._set_embedding(model) and \
            all(mgr.batch is None for mgr in self.lora_managers)

    def run_burst(self, model, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta, k: int,
                  stop_ids: list) -> Optional[list]:
        """Up to k greedy decode steps in one call (DecodeStep.run_burst; backend/decode_burst.py
        says which steps): meta a decode-only step's (NativeDecode's rows); the tokens of each step
        run, or None where the call cannot run this model's lookup and head (the caller steps
        once)."""
        if not (self._set_head(model) and self._set_embedding(model)
                and self._ready(input_ids, positions, kv_caches, meta)):
            return None
        plan = meta.cpu_plan
        return self.step.run_burst(input_ids, positions, meta.slot_mapping, plan.block_tables,
                                   plan.rows_for(meta, self.window), kv_caches[0][0].shape[1], k, self.window,
                                   stop_ids)

    def run_step(self, model, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta,
                 logits: bool = False):
        """The whole step natively (kernels/decode_step.py: embedding lookup, rotary rows, every
        layer, final norm), or None where this step does not take it (the caller runs
        DecoderLM.forward's parts). Returns the final norm's output (T, hidden); with `logits`,
        (float32 logits (T, vocab), each row's argmax) from the LM head in the same call, or None
        where the call does not run this model's head."""
        if not self._ready(input_ids, positions, kv_caches, meta):
            return None
        if logits and not self._set_head(model):
            return None
        hidden = None if self._set_embedding(model) else model.embed(input_ids).contiguous()
        k0 = kv_caches[0][0]
        plan = getattr(meta, "cpu_plan", None) or ops.attention_plan(meta)
        return self.step.run(input_ids, positions, hidden, meta.slot_mapping.to(torch.int64).contiguous(),
                             plan.block_tables, plan.rows_for(meta, self.window), k0.shape[1], logits)
