"""Every consumer of the int4 layout reads an imported engine's tensors correctly: the Triton
W4A16 GEMM (under TRITON_INTERPRET=1, against x @ dequantize_int4(...)^T, float32 tolerance) and
the CPU Int4Linear (torch's packed int4 kernel, bf16 activations: 2e-2 relative), on the GPTQ
act-order fixture (float32 zeros that float16 cannot hold, g_idx) and the AWQ one."""
from __future__ import annotations

import kernel_env  # noqa: F401  (TRITON_INTERPRET=1 before the kernel modules load)

import os

import pytest
import torch
from safetensors.torch import load_file

from test_quant_import_gptq_awq import prequant_checkpoint
from prequant_ct import float_source

from tritium.backend.config import EngineConfig
from tritium.backend.quant import Int4Linear
from tritium.builder.build import BuildOptions, build_engine
from tritium.kernels.gemm_triton import w4a16_gemm
from tritium.kernels.quant_layouts import dequantize_int4


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    d = tmp_path_factory.mktemp("imp")
    src = float_source(str(d / "float"), num_hidden_layers=1)
    out = {}
    for variant in ("gptq_v1_asym_desc_act_g32", "awq_gemm_g32"):
        ck = prequant_checkpoint(src, str(d / variant), variant)
        eng = str(d / (variant + "_engine"))
        build_engine(BuildOptions(source=ck, output=eng, dtype="float32", progress=False))
        out[variant] = (EngineConfig.load(eng), load_file(os.path.join(eng, "rank0.safetensors")))
    return out


@pytest.mark.parametrize("variant", ["gptq_v1_asym_desc_act_g32", "awq_gemm_g32"])
@pytest.mark.parametrize("lin", ["qkv_proj", "down_proj"])
def test_imported_int4_consumers(engines, variant, lin):
    cfg, t = engines[variant]
    name = f"layers.0.{lin}"
    lq = cfg.quantization.layers[name]
    qw, s, z, g = (t[name + ".qweight"], t[name + ".scales"], t[name + ".zeros"], t.get(name + ".g_idx"))
    assert z.dtype == torch.float32 and s.dtype == torch.float32
    assert (g is not None) == ("desc_act" in variant)
    w = dequantize_int4(qw, s, z, lq.group_size, g)
    x = torch.randn(7, w.shape[1])
    ref = x @ w.t()
    got = w4a16_gemm(x, qw, s, z, lq.group_size, g)
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max(), (got - ref).abs().max()
    layer = Int4Linear(w.shape[1], w.shape[0], False, torch.float32, lq)
    for key in ("qweight", "scales", "zeros") + (("g_idx",) if g is not None else ()):
        layer._buffers[key] = t[name + "." + key].to(layer._buffers[key].dtype)
    for rows in (1, 7, 80):  # decode, the packed kernel, and the dequantize-to-bf16 prefill path
        xr = torch.randn(rows, w.shape[1])
        y, r = layer(xr), xr @ w.t()
        assert ((y - r).norm() / r.norm()).item() < 2e-2, rows
