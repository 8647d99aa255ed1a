"""Per-expert calibration of quantized experts (builder/quant/moe_calibration.py) on a tiny
Qwen3-MoE layer, checked against the definitions rather than against the code:

- GPTQ (Frantar et al., 2022) minimises the output error ||(Q - W) X|| on the calibration inputs:
  on each expert's own routed tokens, GPTQ int4 and GPTQ-on-E4M3 experts have a lower output
  error than round-to-nearest of the same format.
- The routed-token counts equal a top-k recomputed here from the router's softmax; an expert no
  token reaches gets its Hessian from the min_tokens tokens with the highest router probability
  for it (recomputed here), and without any calibration token every expert falls back to RTN.
"""
from __future__ import annotations

import pytest
import torch

import test_models_moe  # noqa: F401 (registers the tiny MoE families)
from tritium.backend.config import LayerQuant
from tritium.backend.loader import load_engine
from tritium.builder.quant.moe_calibration import ExpertHessians
from tritium.builder.quant.quant_layers import quantize_weight

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def layer(tiny_engine):
    _, model, _ = load_engine(tiny_engine("qwen3_moe", "float32"), "cpu")
    lay = model.layers[1]
    assert lay.sparse and lay.experts.gate_up_weight.shape == (8, 64, 64)
    return lay


def _inputs(n: int, seed: int = 0) -> torch.Tensor:
    """Hidden states with correlated, unevenly scaled channels (where GPTQ's feedback matters)."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(64, 64, generator=g) * torch.logspace(0, -1.5, 64)[:, None]
    return torch.randn(n, 64, generator=g) @ mix + 0.3


def _routed(layer, x):
    probs = torch.softmax(x @ layer.router.weight.t(), -1)
    return probs, torch.topk(probs, layer.top_k, -1).indices


@pytest.mark.parametrize("method", ["int4-gptq", "fp8"])
def test_gptq_experts_beat_rtn_on_their_routed_tokens(layer, method):
    x = _inputs(600)
    cal = ExpertHessians(layer)
    with torch.no_grad():
        cal.add(x)
    hs = cal.finish()
    _, ids = _routed(layer, x)
    lq = LayerQuant("int4", group_size=32, static_groups=True) if method == "int4-gptq" else LayerQuant("fp8")
    rtn = "int4-rtn" if method == "int4-gptq" else "fp8"
    for proj in ("gate_up", "down"):
        w_all = getattr(layer.experts, f"{proj}_weight").float()
        tot = {"gptq": 0.0, "rtn": 0.0}
        wins = 0
        for e in range(8):
            rows = x[(ids == e).any(1)]
            if proj == "down":
                rows = layer.act_mul(rows @ layer.experts.gate_up_weight[e].float().t())
            w = w_all[e]
            _, q_g = quantize_weight(w, lq, method, {"H": hs[proj][e]})
            _, q_r = quantize_weight(w, lq, rtn, None)
            eg, er = ((rows @ (q_g - w).t()) ** 2).sum().item(), ((rows @ (q_r - w).t()) ** 2).sum().item()
            tot["gptq"] += eg
            tot["rtn"] += er
            wins += eg < er
        assert tot["gptq"] < 0.9 * tot["rtn"], (method, proj, tot)
        assert wins >= 6, (method, proj, wins)


def test_counts_and_an_expert_no_token_reaches(layer):
    x = _inputs(300, seed=1)
    x[:, 0] = x[:, 0].abs() + 1.0  # every token has a positive first channel...
    saved = layer.router.weight.clone()
    try:
        with torch.no_grad():
            layer.router.weight[7] = 0.0
            layer.router.weight[7, 0] = -30.0  # ...so expert 7's logit is very negative: never chosen
        probs, ids = _routed(layer, x)
        cal = ExpertHessians(layer, min_tokens=40)
        with torch.no_grad():
            for chunk in x.split(128):  # in chunks, as the calibration runner feeds them
                cal.add(chunk)
        out = cal.finish()
        rep = out["report"]
        want = torch.bincount(ids.reshape(-1), minlength=8).tolist()
        assert rep["routed_tokens_per_expert"] == want and want[7] == 0
        assert rep["experts_without_tokens"] == 1 and 7 in rep["experts_augmented"]
        assert rep["experts_below_min_tokens"] == sum(1 for c in want if c < 40)
        assert rep["experts_round_to_nearest"] == []
        # expert 7's Hessian: exactly the 40 tokens the router ranks highest for it
        top = x[torch.topk(probs[:, 7], 40).indices]
        assert torch.allclose(out["gate_up"][7].hessian(), 2 * top.t() @ top / 40, rtol=1e-4, atol=1e-5)
    finally:
        with torch.no_grad():
            layer.router.weight.copy_(saved)


def test_no_calibration_tokens_falls_back_to_rtn(layer):
    rep = ExpertHessians(layer).finish()
    assert rep["gate_up"] == [None] * 8 and rep["report"]["experts_round_to_nearest"] == list(range(8))
