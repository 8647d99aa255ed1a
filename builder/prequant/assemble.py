"""Assemble an engine state dict from a pre-quantized checkpoint: the float tensors as
builder/convert.py maps them, and each decoder linear from its format's reader, fused
(q, k, v -> qkv_proj; gate, up -> gate_up_proj) and packed into Tritium's layouts."""
from __future__ import annotations

from typing import Dict, Tuple

import torch

from tritium.backend.config import IMPORTED_QUANTIZATION, LayerQuant, ModelConfig, QuantConfig
from tritium.kernels.quant_layouts import FP8_LAYOUT, INT4_LAYOUT, INT8_GROUPED_LAYOUT, INT8_LAYOUT

from ..convert import CheckpointError
from .awq import read_linear as read_awq
from .compressed import read_linear as read_compressed
from .gptq import read_linear as read_gptq
from .linear import ImportedLinear, engine_tensors, fuse
from .spec import ImportSpec

_PARTS = {"qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "o_proj": ("self_attn.o_proj",),
          "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
          "down_proj": ("mlp.down_proj",)}


def _read(ckpt, spec: ImportSpec, module: str) -> ImportedLinear:
    scheme = spec.scheme_for(module)
    if scheme is None:
        return ImportedLinear("none", {"weight": ckpt.get(module + ".weight")})
    if spec.format == "gptq":
        return read_gptq(ckpt.get, ckpt.has, module, scheme, spec.gptq_v1_zeros)
    if spec.format == "awq":
        return read_awq(ckpt.get, ckpt.has, module, scheme)
    return read_compressed(ckpt.get, ckpt.has, module, scheme)


def _check_shape(name: str, lin: ImportedLinear, n: int, k: int) -> None:
    t = lin.tensors.get("codes", lin.tensors.get("qweight", lin.tensors.get("weight")))
    if tuple(t.shape) != (n, k):
        raise CheckpointError(f"{name}: the stored weight decodes to shape {tuple(t.shape)} but the config implies "
                              f"{(n, k)}")


def imported_engine_tensors(m: ModelConfig, ckpt, dtype: torch.dtype, spec: ImportSpec, source: str, progress=None
                            ) -> Tuple[Dict[str, torch.Tensor], Dict[str, LayerQuant]]:
    """(engine tensors, LayerQuant per engine linear) of a pre-quantized HF checkpoint."""
    for head in ("lm_head", "model.embed_tokens"):
        if spec.scheme_for(head) is not None and (ckpt.has(head + ".qweight") or ckpt.has(head + ".weight_packed")
                                                  or ckpt.has(head + ".weight_scale")):
            raise CheckpointError(f"{source}: {head} is stored quantized; importing a quantized embedding or LM "
                                  f"head is not supported (keep it in float: add it to the ignore list)")
    h, d = m.hidden_size, m.head_dim
    qd, kvd = m.num_heads * d, m.num_kv_heads * d
    out_in = {"qkv_proj": ((qd, kvd, kvd), h), "o_proj": ((h,), qd),
              "gate_up_proj": ((m.intermediate_size,) * 2, h), "down_proj": ((h,), m.intermediate_size)}

    def float_t(name, shape):
        t = ckpt.get(name)
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"{source}: tensor {name!r} has shape {tuple(t.shape)} but the config implies "
                                  f"{tuple(shape)}")
        return t.to(dtype).contiguous()

    tensors: Dict[str, torch.Tensor] = {"embed_tokens.weight": float_t("model.embed_tokens.weight", (m.vocab_size, h))}
    plan: Dict[str, LayerQuant] = {}
    for i in range(m.num_layers):
        p = f"model.layers.{i}."
        tensors[f"layers.{i}.input_norm.weight"] = float_t(p + "input_layernorm.weight", (h,))
        tensors[f"layers.{i}.post_attn_norm.weight"] = float_t(p + "post_attention_layernorm.weight", (h,))
        for lin, parts in _PARTS.items():
            outs, k = out_in[lin]
            read = []
            for part, n in zip(parts, outs):
                one = _read(ckpt, spec, p + part)
                _check_shape(p + part, one, n, k)
                read.append(one)
            fused = fuse(read, f"layers.{i}.{lin}") if len(read) > 1 else read[0]
            for suffix, t in engine_tensors(fused, dtype).items():
                tensors[f"layers.{i}.{lin}.{suffix}"] = t.contiguous()
            plan[f"layers.{i}.{lin}"] = LayerQuant(
                fused.method, group_size=fused.group_size, act_order="g_idx" in fused.tensors,
                group_reason=f"imported ({spec.format})" if fused.group_size is not None else None)
        if m.attention_bias:
            tensors[f"layers.{i}.qkv_proj.bias"] = torch.cat(
                [float_t(p + "self_attn.q_proj.bias", (qd,)), float_t(p + "self_attn.k_proj.bias", (kvd,)),
                 float_t(p + "self_attn.v_proj.bias", (kvd,))], 0)
        if progress is not None:
            progress.update()
    tensors["norm.weight"] = float_t("model.norm.weight", (h,))
    if not m.tie_word_embeddings:
        if not ckpt.has("lm_head.weight"):
            raise CheckpointError(f"{source}: tensor 'lm_head.weight' missing and tie_word_embeddings is false")
        tensors["lm_head.weight"] = float_t("lm_head.weight", (m.vocab_size, h))
    return tensors, plan


def imported_quant_config(spec: ImportSpec, plan: Dict[str, LayerQuant], tensors: Dict[str, torch.Tensor],
                          dtype: torch.dtype) -> Tuple[QuantConfig, dict, int]:
    """(engine.json's QuantConfig, build_report.json's quantization_report, float-equivalent bytes)."""
    layouts = {"int4": INT4_LAYOUT + " (imported: scales and zeros stored float32, exact for the source's "
                                     "float16 / bfloat16 scales)",
               "int8": INT8_LAYOUT + " (imported: the source's scales, not necessarily bfloat16 values)",
               "fp8": FP8_LAYOUT + " (imported: the source's per-tensor or per-channel scales)"}
    layouts["int8 grouped"] = INT8_GROUPED_LAYOUT + " (imported: the source's group scales)"
    used = {lq.method + (" grouped" if lq.method == "int8" and lq.group_size else "") for lq in plan.values()}
    qcfg = QuantConfig(method=IMPORTED_QUANTIZATION, layers=dict(plan),
                       layouts={k: v for k, v in layouts.items() if k in used}, imported=dict(spec.summary))
    esize = torch.empty((), dtype=dtype).element_size()
    float_bytes = 0
    for name, t in tensors.items():
        base, _, leaf = name.rpartition(".")
        lq = plan.get(base)
        if lq is None or lq.method == "none":
            float_bytes += t.numel() * esize
        elif leaf == "qweight":
            float_bytes += t.shape[0] * (t.shape[1] * (2 if lq.method == "int4" else 1)) * esize
    report = {"method": IMPORTED_QUANTIZATION, "imported": dict(spec.summary),
              "layers": {name: {"method": lq.method, "group_size": lq.group_size, "act_order": lq.act_order}
                         for name, lq in plan.items()},
              "requantized": False}
    if "fp8" in used:
        report["note"] = ("fp8 weights run weight-only: the source's activation quantization (input scales or "
                          "dynamic per-token fp8) is not applied on CPU; the GPU path quantizes activations "
                          "dynamically per token where the device has fp8 matmul")
    return qcfg, report, float_bytes
