"""compressed-tensors checkpoints made with the library itself (the oracle for imports).

make_ct_checkpoint quantizes a tiny random Llama with compressed-tensors' own API: a preset
scheme (W4A16, W4A16_ASYM, W8A16, FP8, FP8_DYNAMIC, ...) applied with apply_quantization_config,
scales and zero points from the library's calculate_qparams over min / max, compressed by
ModelCompressor and saved with save_pretrained + update_config, as llm-compressor does after its
calibration. ct_dequantized_model decompresses the saved file with the library's compressors
into a float HF model (the reference the engine is compared with).
"""
from __future__ import annotations

import json
import os
import shutil

import torch

from tiny_models import make_checkpoint
from tritium.kernels.quant_layouts import dequantize_grouped, dequantize_int4, dequantize_rowwise

# dims that every supported group size (32..128) divides; 2 layers
IMPORT_DIMS = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=32, num_hidden_layers=2)


def float_source(path: str, seed: int = 0, **overrides) -> str:
    return make_checkpoint("llama", path, seed=seed, init_std=0.05, **{**IMPORT_DIMS, **overrides})


def make_ct_checkpoint(float_dir: str, out: str, preset: str, dtype=torch.bfloat16, group_size=None,
                       strategy=None, ignore=("lm_head",), fmt=None) -> str:
    """Quantize `float_dir` with compressed-tensors' preset `preset` and save to `out` (in the
    compression format the library infers, or `fmt`, e.g. "int-quantized")."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(float_dir, dtype=dtype)
    scheme = preset_name_to_scheme(preset, ["Linear"])
    if group_size is not None or strategy is not None:
        w = scheme.weights.model_dump()
        w.update({k: v for k, v in (("group_size", group_size), ("strategy", strategy)) if v is not None})
        if w["strategy"] != "group":
            w["group_size"] = None
        scheme.weights = type(scheme.weights).model_validate(w)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(ignore)))
    for _, mod in model.named_modules():
        s = getattr(mod, "quantization_scheme", None)
        if s is None:
            continue
        w, a = mod.weight.data, s.weights
        if a.strategy == "group":
            wg = w.reshape(w.shape[0], -1, a.group_size)
            mn, mx = wg.amin(-1), wg.amax(-1)
        elif a.strategy == "channel":
            mn, mx = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
        else:
            mn, mx = w.amin().reshape(1), w.amax().reshape(1)
        scale, zp = calculate_qparams(mn, mx, a)
        mod.weight_scale.data = scale.to(mod.weight_scale.dtype).reshape(mod.weight_scale.shape)
        if hasattr(mod, "weight_zero_point"):
            mod.weight_zero_point.data = zp.to(mod.weight_zero_point.dtype).reshape(mod.weight_zero_point.shape)
        if hasattr(mod, "input_scale"):  # static fp8 activations: any calibrated value will do here
            mod.input_scale.data = torch.full_like(mod.input_scale, 0.01)
    comp = ModelCompressor.from_pretrained_model(model, fmt)
    comp.compress_model(model)
    if os.path.isdir(out):
        shutil.rmtree(out)
    model.save_pretrained(out)
    comp.update_config(out)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if os.path.isfile(os.path.join(float_dir, f)):
            shutil.copy(os.path.join(float_dir, f), out)
    return out


def ct_dequantized_state(path: str) -> dict:
    """HF name -> float32 weight of every quantized module, decompressed by the library's own
    compressors (compressed-tensors' decompress per module). The scales are handed to it as
    float32, so its (q - zero_point) * scale is the exact product (for bfloat16 scales), not
    rounded back to bfloat16."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file
    with open(os.path.join(path, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    cfg = QuantizationConfig.model_validate(qc)
    sd = load_file(os.path.join(path, "model.safetensors"))
    modules = sorted({k.rsplit(".", 1)[0] for k in sd if k.endswith(".weight_scale")})
    out = {}
    for mod in modules:
        scheme = next(iter(cfg.config_groups.values()))
        fmt = cfg.config_groups[next(iter(cfg.config_groups))].format or cfg.format
        comp = BaseCompressor.load_from_registry(fmt)
        local = {k[len(mod) + 1:]: v for k, v in sd.items() if k.startswith(mod + ".")}
        local["weight_scale"] = local["weight_scale"].float()
        out[mod + ".weight"] = comp.decompress(local, scheme)["weight"]
    return out


def ct_reference_model(path: str, float_dir: str):
    """The float32 HF model whose quantized linears hold the library's decompressed weights."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32)
    deq = ct_dequantized_state(path)
    from safetensors.torch import load_file
    sd = load_file(os.path.join(path, "model.safetensors"))
    state = model.state_dict()
    for name in state:
        if name in deq:
            state[name] = deq[name].float()
        elif name in sd:
            state[name] = sd[name].float()
    model.load_state_dict(state)
    return model.eval()


def rel_l2(a, b) -> float:
    """Relative L2 distance of a from b."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def engine_weight(tensors, cfg, name):
    """The float weight (N, K) of engine linear `name`, dequantized from its stored layout."""
    lq = cfg.quantization.layers[name]
    if lq.method == "int4":
        return dequantize_int4(tensors[name + ".qweight"], tensors[name + ".scales"], tensors[name + ".zeros"],
                               lq.group_size, tensors.get(name + ".g_idx"))
    if lq.group_size is not None:
        return dequantize_grouped(tensors[name + ".qweight"], tensors[name + ".scales"], tensors.get(name + ".zeros"),
                                  lq.group_size)
    return dequantize_rowwise(tensors[name + ".qweight"], tensors[name + ".scales"])
