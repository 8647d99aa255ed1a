"""SmoothQuant's per-linear strength chosen by the calibration error (builder/quant/smoothquant_search.py,
docs/quantization.md#integer-dot-w8a8--w4a8): a linear whose inputs carry outlier channels is
smoothed and its W8A8 error drops; a linear without them, whose weights sit on a source grid, is
not made worse than unsmoothed; end to end on tiny models an `auto` build's W8A8 logits are
closer to the float model's than an unsmoothed build's when outliers are injected, and no further
from them when none are. Errors are measured here from the definitions (activations rounded to
bfloat16 then to int8 per row and block of 32, amax / 127; the build's own weight rounding)."""
from __future__ import annotations

import os

import pytest
import torch

from tritium.backend.config import LayerQuant
from tritium.builder.quant.quant_layers import quantize_weight
from tritium.builder.quant.smoothquant import input_factors, linear_factors
from tritium.builder.quant.smoothquant_search import ALPHA_CANDIDATES, choose_alphas
from tritium.kernels import cpu_native
from tests.test_quant_pipeline import DIMS, PROMPT, _logits

SOURCE_GRID = LayerQuant(method="int8", group_size=32, asymmetric=True)  # the int8 default's layout


def _act_quant(x: torch.Tensor) -> torch.Tensor:
    """The integer-dot kernels' activations, written from the definition (docs/quantization.md)."""
    xb = x.to(torch.bfloat16).double().view(x.shape[0], -1, 32)
    d = xb.abs().amax(dim=2, keepdim=True) / 127.0
    q = torch.where(d > 0, torch.round(xb / torch.where(d > 0, d, torch.ones_like(d))), torch.zeros_like(xb))
    return (q * d).view(x.shape)


def _w8a8_error(x: torch.Tensor, w: torch.Tensor, alpha) -> float:
    """|| Qa(X / s) Qw(W s)^T - X W^T ||^2 for SmoothQuant's factors at `alpha` (None: unsmoothed)."""
    s = torch.ones(w.shape[1]) if alpha is None else input_factors(
        None, "qkv_proj", linear_factors(None, "qkv_proj", w, x.abs().amax(0), alpha))
    _, deq = quantize_weight(w * s, SOURCE_GRID, "int8", None)
    return float((_act_quant(x / s) @ deq.double().t() - (x @ w.t()).double()).pow(2).sum())


def _q41_weight(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Weights on a GGUF Q4_1 grid (w = d q + m per block of 32, d and m float16): the int8
    build stores them exactly unless smoothing moves them off it."""
    q = torch.randint(0, 16, (n, k // 32, 32), generator=gen).float()
    d = (torch.rand(n, k // 32, 1, generator=gen) * 0.01 + 0.002).half().float()
    m = (-8 * d).half().float()
    return (q * d + m).view(n, k)


def test_linear_with_outlier_channels_is_smoothed():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 64, generator=gen)
    x[:, [5, 37]] *= 60.0  # two outlier channels, as in the paper's Figure 4
    w = torch.randn(48, 64, generator=gen) * 0.05
    got = choose_alphas(None, ["qkv_proj"], {"qkv_proj": w}, {"qkv_proj": x.abs().amax(0)},
                        {"qkv_proj": x}, {"qkv_proj": SOURCE_GRID}, "int8")["qkv_proj"]
    assert got["alpha"] is not None, got["errors"]
    assert set(got["errors"]) == set(ALPHA_CANDIDATES)
    chosen, unsmoothed = _w8a8_error(x, w, got["alpha"]), _w8a8_error(x, w, None)
    assert chosen < 0.5 * unsmoothed, (got["alpha"], chosen, unsmoothed)
    # the search's own figures agree with the definition's
    assert got["errors"][got["alpha"]] == pytest.approx(chosen, rel=1e-3)
    assert got["errors"][None] == pytest.approx(unsmoothed, rel=1e-3)


def test_linear_without_outliers_on_a_source_grid_is_not_made_worse():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(512, 64, generator=gen)
    w = _q41_weight(48, 64, gen)
    got = choose_alphas(None, ["gate_up_proj"], {"gate_up_proj": w}, {"gate_up_proj": x.abs().amax(0)},
                        {"gate_up_proj": x}, {"gate_up_proj": SOURCE_GRID}, "int8")["gate_up_proj"]
    assert _w8a8_error(x, w, got["alpha"]) <= _w8a8_error(x, w, None) * (1 + 1e-6)
    assert got["errors"][0.5] > got["errors"][None], "the test's premise: alpha 0.5 costs here"


def test_width_not_a_multiple_of_32_is_never_smoothed():
    x, w = torch.randn(64, 48), torch.randn(16, 48)
    got = choose_alphas(None, ["down_proj"], {"down_proj": w}, {"down_proj": x.abs().amax(0)},
                        {"down_proj": x}, {"down_proj": SOURCE_GRID}, "int8")
    assert got["down_proj"]["alpha"] is None


@pytest.fixture(scope="module")
def float_model(tiny_checkpoint, tmp_path_factory):
    from safetensors.torch import load_file
    from tritium.backend.config import EngineConfig
    from tritium.builder.build import BuildOptions, build_engine
    src = tiny_checkpoint("llama", **DIMS)
    out = str(tmp_path_factory.mktemp("sqsearch") / "engine")
    build_engine(BuildOptions(source=src, output=out, dtype="float32", progress=False))
    cfg = EngineConfig.load(out)
    return src, cfg, load_file(os.path.join(out, cfg.weights_file(0)))


def _w8a8_logit_error(src, cfg, tensors, **kw) -> tuple:
    """(mean squared logit error of the int8 W8A8 build against the float model, build report)."""
    import dataclasses
    from tritium.backend.models.decoder import DecoderLM
    from tritium.backend.quant import set_activation_quant
    from tritium.builder.quant import quant_pipeline as qp
    new, qcfg, kvcfg, report = qp.quantize_engine_weights(
        cfg, tensors, quantization="int8", activation_quant="int8", source=src, eval_tokens=0,
        calibration_samples=8, progress=False, **kw)
    model = DecoderLM(dataclasses.replace(cfg, quantization=qcfg, kv_cache=kvcfg))
    model.load_engine_weights(new)
    set_activation_quant(model.eval(), "int8")
    ids = PROMPT + list(range(60, 100))
    ref = _logits(qp._float_model(cfg, tensors), ids)
    return float((_logits(model, ids) - ref).pow(2).mean()), report


@pytest.mark.skipif(not cpu_native.available(),
                    reason="native CPU kernels unavailable (TRITIUM_NATIVE_CPU=0 or no compiler): no W8A8 to score")
@pytest.mark.parametrize("outliers", [True, False])
def test_auto_build_against_unsmoothed_end_to_end(float_model, outliers):
    src, cfg, tensors = float_model
    tensors = dict(tensors)
    if outliers:  # a few large channels into every qkv_proj / gate_up_proj input
        for i in range(cfg.model.num_layers):
            for norm in ("input_norm.weight", "post_attn_norm.weight"):
                t = tensors[f"layers.{i}.{norm}"].clone()
                t[[7, 50]] *= 40.0
                tensors[f"layers.{i}.{norm}"] = t
    auto, report = _w8a8_logit_error(src, cfg, tensors, smoothquant_alpha="auto")
    off, _ = _w8a8_logit_error(src, cfg, tensors, smoothquant=False)
    sq = report["smoothquant"]
    assert sq["alpha"] == "auto" and sum(sq["alpha_counts"].values()) == 4 * cfg.model.num_layers
    assert 0 < sq["calibration_error_vs_unsmoothed"] <= 1.0
    if outliers:
        assert any(name.endswith(("qkv_proj", "gate_up_proj")) for name in sq["layers"]), sq["alpha_counts"]
        assert auto < 0.8 * off, (auto, off)
    else:
        assert auto <= 1.05 * off, (auto, off)


def test_console_line_of_an_auto_build():
    from tritium.builder.report import activation_line
    report = {"activation_quant": "int8", "quantization": "int8",
              "quantization_report": {"method": "int8", "smoothquant": {
                  "alpha": "auto", "linears": 3, "alpha_counts": {"none": 2, "0.9": 2, "0.5": 1}}}}
    line = activation_line(report)
    assert "(W8A8; GPUs run weight-only); SmoothQuant alpha per linear by calibration error (0.5 x1, 0.9 x2; " \
           "2 left unsmoothed)" in line, line


def test_which_builds_centre_their_head():
    """int8 weights with int8 activations centre the LM head where a tokenizer gives the calibration
    mean; an explicit choice, weight-only builds and int4 builds keep theirs (None: quant_head's default)."""
    from tritium.builder.quant.quant_head import centred_head
    from tritium.builder.quant.quant_pipeline import QuantOptions
    tok = object()
    assert centred_head(QuantOptions(quantization="int8", activation_quant="int8"), tok) is True
    assert centred_head(QuantOptions(quantization="int8", activation_quant="int8"), None) is False
    assert centred_head(QuantOptions(quantization="int8", activation_quant="int8", head_centring=False), tok) is False
    assert centred_head(QuantOptions(quantization="int8", activation_quant="none"), tok) is None
    assert centred_head(QuantOptions(quantization="int4-rtn", activation_quant="int8"), tok) is None
