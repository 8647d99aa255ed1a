"""The MoE part of the Hugging Face -> engine tensor mapping (convert.py calls it per sparse layer).

Per-expert HF matrices are stacked into the fused op's layout (backend/models/moe.py): gate and up
rows of expert e into experts.gate_up_weight[e] = [gate; up] (2I, hidden), down into
experts.down_weight[e] (hidden, I); the router (HF `gate`) and a shared expert keep their shapes.
"""
from __future__ import annotations

from typing import Callable, Iterator, Optional, Tuple

import torch

from tritium.backend.config import ModelConfig


def moe_layer_tensors(m: ModelConfig, fam, i: int, g: Callable[[str, tuple], torch.Tensor]
                      ) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield layer i's MoE engine tensors; g(hf_name, shape) reads and shape-checks one tensor."""
    h, inter, e_n = m.hidden_size, m.moe_intermediate_size, m.num_experts
    p = f"model.layers.{i}.{fam.moe_block}."
    gate, up, down = fam.expert_names
    yield f"layers.{i}.router.weight", g(p + "gate.weight", (e_n, h))
    yield f"layers.{i}.experts.gate_up_weight", torch.stack([torch.cat([
        g(f"{p}experts.{e}.{gate}.weight", (inter, h)), g(f"{p}experts.{e}.{up}.weight", (inter, h))], 0)
        for e in range(e_n)])
    yield f"layers.{i}.experts.down_weight", torch.stack([
        g(f"{p}experts.{e}.{down}.weight", (h, inter)) for e in range(e_n)])
    si = m.shared_expert_intermediate_size
    if si:
        s = p + fam.shared_expert_name + "."
        yield f"layers.{i}.shared_expert.gate_up_proj.weight", torch.cat([
            g(s + "gate_proj.weight", (si, h)), g(s + "up_proj.weight", (si, h))], 0)
        yield f"layers.{i}.shared_expert.down_proj.weight", g(s + "down_proj.weight", (h, si))
        if m.shared_expert_gate:
            yield f"layers.{i}.shared_expert_gate.weight", g(p + "shared_expert_gate.weight", (1, h))


# Per expert (builder/quant/quant_moe.py): round to nearest, or GPTQ on each expert's routed tokens.
MOE_QUANTIZATION = ("none", "int8", "fp8", "int4-rtn", "int4-gptq")


def check_moe_build(m: ModelConfig, opts, imported, mxfp4: bool = False) -> None:
    """Refuse, before any work, what the engine cannot do with experts yet (ValueError naming the flag).
    mxfp4: the source is an MXFP4 gpt-oss checkpoint (experts imported as stored)."""
    if not m.num_experts:
        return
    if mxfp4 and opts.tensor_parallel_size > 1:
        raise ValueError(f"--tensor-parallel-size {opts.tensor_parallel_size}: the MXFP4 experts of an MXFP4 "
                         f"checkpoint are not split across ranks yet; allowed: --tensor-parallel-size 1 (or a "
                         f"float checkpoint)")
    if mxfp4 and (opts.quantization != "none" or opts.kv_cache_dtype != "auto"):
        raise ValueError(f"--quantization {opts.quantization} / --kv-cache-dtype {opts.kv_cache_dtype}: an MXFP4 "
                         f"checkpoint's experts are imported as stored (MXFP4); allowed: --quantization none "
                         f"--kv-cache-dtype auto")
    if opts.tensor_parallel_size > 1 and opts.quantization != "none":
        raise ValueError(f"--tensor-parallel-size {opts.tensor_parallel_size} with --quantization {opts.quantization}: "
                         f"the quantized experts of mixture-of-experts models ({m.architecture}) are not split across ranks yet; allowed: "
                         f"--quantization none with tensor parallelism, or --tensor-parallel-size 1")
    if opts.quantization not in MOE_QUANTIZATION or imported is not None:
        what = f"--quantization {opts.quantization}" if imported is None else "a pre-quantized source"
        raise ValueError(f"{what}: not supported for mixture-of-experts models ({m.architecture}) yet; "
                         f"allowed: --quantization {' / '.join(MOE_QUANTIZATION)}")


def shard_moe_tensor(name: str, t: torch.Tensor, layout, r: int) -> Optional[torch.Tensor]:
    """Rank r's part of an MoE engine tensor (builder/tp_shard.py), None if `name` is not one.
    Experts and the shared expert are split by columns like a dense MLP: [gate; up] rows and down
    columns of the rank's intermediate features; the router and the shared expert's gate are
    replicated (every rank routes the same, identical hidden states). gpt-oss's gate_up biases
    follow their columns; its down biases stay on rank 0 (zeros elsewhere), added once by the sum."""
    if ".experts." not in name and ".shared_expert." not in name:
        return None
    if name.endswith("experts.down_bias"):  # gpt-oss: added once, on rank 0, before the all-reduce
        return t if r == 0 else torch.zeros_like(t)
    shared = ".shared_expert." in name
    start = sum(lay.shared_intermediate if shared else lay.moe_intermediate for lay in layout[:r])
    width = layout[r].shared_intermediate if shared else layout[r].moe_intermediate
    cols = torch.arange(start, start + width)
    if name.endswith(("experts.gate_up_weight", "shared_expert.gate_up_proj.weight")):
        inter = t.shape[-2] // 2
        return t.index_select(t.dim() - 2, torch.cat([cols, inter + cols]))
    if name.endswith("experts.gate_up_bias"):  # gpt-oss: (E, 2I) [gate; up] like the rows above
        inter = t.shape[-1] // 2
        return t.index_select(1, torch.cat([cols, inter + cols]))
    if name.endswith(("experts.down_weight", "shared_expert.down_proj.weight")):
        return t.index_select(t.dim() - 1, cols)
    raise ValueError(f"{name}: no tensor-parallel split for this MoE tensor (quantized experts are not split)")
