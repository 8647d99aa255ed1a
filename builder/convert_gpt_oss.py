"""gpt-oss's part of the Hugging Face -> engine tensor mapping, and its MXFP4 checkpoints.

Per layer (model.layers.{i}.): the attention sinks, the router (weight and bias), and the stacked
experts. HF stores them transposed for `x @ W` with gate / up interleaved in the columns of
gate_up_proj (E, hidden, 2I) (gate = even columns, up = odd); the engine's fused-MoE layout is
(E, N, K) rows with [gate; up] stacked, so the float weights are transposed and de-interleaved.
MXFP4 checkpoints (quantization_config.quant_method "mxfp4", OpenAI's published weights) store
the experts as `{proj}_blocks` (E, N, K // 32, 16) uint8 and `{proj}_scales` (E, N, K // 32)
uint8, already (N, K) per expert: the bytes are kept as stored (engine method "mxfp4",
kernels/mxfp4.py), only gate_up's rows de-interleaved. Biases stay float.
"""
from __future__ import annotations

from typing import Callable, Iterator, Optional, Tuple

import torch

from tritium.backend.config import IMPORTED_QUANTIZATION, LayerQuant, ModelConfig, QuantConfig
from tritium.kernels.mxfp4 import MXFP4_BLOCK, MXFP4_LAYOUT, mxfp4_from_hf


def _deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """[g0, u0, g1, u1, ...] along `dim` -> [g0, g1, ...; u0, u1, ...]."""
    n = t.shape[dim]
    order = torch.cat([torch.arange(0, n, 2), torch.arange(1, n, 2)])
    return t.index_select(dim, order)


def gpt_oss_layer_tensors(m: ModelConfig, i: int, g: Callable[[str, tuple], torch.Tensor],
                          raw: Callable[[str, tuple], torch.Tensor], has: Callable[[str], bool]
                          ) -> Iterator[Tuple[str, torch.Tensor]]:
    """Layer i's sinks, router and experts as engine tensors; g(hf_name, shape) reads a float
    tensor in the engine dtype, raw(hf_name, shape) one as stored (the MXFP4 bytes); both check
    the shape (convert.py)."""
    h, inter, e_n = m.hidden_size, m.moe_intermediate_size, m.num_experts
    p = f"model.layers.{i}."
    yield f"layers.{i}.sinks", g(p + "self_attn.sinks", (m.num_heads,))
    yield f"layers.{i}.router.weight", g(p + "mlp.router.weight", (e_n, h))
    yield f"layers.{i}.router.bias", g(p + "mlp.router.bias", (e_n,))
    x = p + "mlp.experts."
    for proj, n, k in (("gate_up", 2 * inter, h), ("down", h, inter)):
        if has(f"{x}{proj}_proj_blocks"):
            blocks = raw(f"{x}{proj}_proj_blocks", (e_n, n, k // MXFP4_BLOCK, MXFP4_BLOCK // 2))
            scales = raw(f"{x}{proj}_proj_scales", (e_n, n, k // MXFP4_BLOCK))
            try:
                qweight, sc = mxfp4_from_hf(blocks, scales)
            except ValueError as e:
                raise ValueError(f"tensor '{x}{proj}_proj_blocks': {e}") from None
            if proj == "gate_up":
                qweight, sc = _deinterleave(qweight, 1), _deinterleave(sc, 1)
            yield f"layers.{i}.experts.{proj}_qweight", qweight
            yield f"layers.{i}.experts.{proj}_scales", sc
        else:
            w = g(f"{x}{proj}_proj", (e_n, k, n)).transpose(1, 2)
            yield f"layers.{i}.experts.{proj}_weight", _deinterleave(w, 1) if proj == "gate_up" else w
        b = g(f"{x}{proj}_proj_bias", (e_n, n))
        yield f"layers.{i}.experts.{proj}_bias", _deinterleave(b, 1) if proj == "gate_up" else b


def mxfp4_source(raw_config: dict, path: str) -> Optional[dict]:
    """The quantization_config of an MXFP4 gpt-oss checkpoint (None for any other source);
    raises ValueError for an MXFP4 config this importer cannot honour."""
    qc = raw_config.get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method") != "mxfp4":
        return None
    if raw_config.get("model_type") != "gpt_oss":
        raise ValueError(f"{path}: quantization_config.quant_method 'mxfp4' is supported for model_type "
                         f"'gpt_oss' only, got {raw_config.get('model_type')!r}")
    return qc


def mxfp4_quant_config(m: ModelConfig, qc: dict) -> QuantConfig:
    """The engine's QuantConfig of an MXFP4 import: every expert projection kept as MXFP4."""
    layers = {f"layers.{i}.experts.{proj}": LayerQuant("mxfp4", group_size=MXFP4_BLOCK,
                                                        group_reason="source MXFP4 blocks of 32")
              for i in range(m.num_layers) if m.sparse(i) for proj in ("gate_up", "down")}
    return QuantConfig(method=IMPORTED_QUANTIZATION, layers=layers, layouts={"mxfp4": MXFP4_LAYOUT},
                       imported={"format": "mxfp4", "block_size": MXFP4_BLOCK,
                                 "modules_to_not_convert": list(qc.get("modules_to_not_convert") or [])})
