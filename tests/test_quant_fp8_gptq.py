"""GPTQ on the FP8 (E4M3) grid against its definition: the stored layout is quantize_fp8's, with
uncorrelated inputs (diagonal Hessian) it is plain rounding, and with correlated or real inputs
it lowers the layer output error ||WX - QX|| compared with plain rounding."""
from __future__ import annotations

import pytest
import torch

from tritium.builder.quant.gptq import HessianAccumulator
from tritium.builder.quant.gptq_fp8 import SCALE_STEPS, fp8_mse_scales, gptq_fp8_quantize
from tritium.builder.quant.quantize_fp8 import dequantize_fp8, fp8_scales, quantize_fp8, round_fp8


def _output_error(w, deq, x):
    return ((x @ (w - deq).t()).norm() / (x @ w.t()).norm()).item()


def _e4m3_values() -> torch.Tensor:
    """Every finite E4M3 value, decoded from its bit pattern (sign, 4-bit exponent with bias 7,
    3-bit mantissa; exponent 0 is subnormal; S.1111.111 is NaN) without torch's float8 cast."""
    vals = []
    for e in range(16):
        for m in range(8):
            if e == 15 and m == 7:
                continue
            v = (m / 8) * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
            vals += [v, -v]
    return torch.tensor(sorted(set(vals)))


def test_gptq_fp8_layout_and_grid():
    torch.manual_seed(0)
    w = torch.randn(24, 64) * torch.rand(24, 1) * 3
    x = torch.randn(512, 64) @ (torch.eye(64) + 0.3 * torch.randn(64, 64))
    acc = HessianAccumulator(64)
    acc.add(x)
    grid = _e4m3_values()
    for mse_scale in (False, True):
        q, s = gptq_fp8_quantize(w, acc.hessian(), mse_scale=mse_scale)
        assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape and s.dtype == torch.float32
        assert torch.isin(q.float(), grid).all()
        assert q.float().abs().max() <= 448
    _, s0 = quantize_fp8(w)
    assert torch.equal(gptq_fp8_quantize(w, acc.hessian(), mse_scale=False)[1], s0)  # amax / 448


def test_gptq_fp8_with_diagonal_hessian_is_plain_rounding():
    """With H diagonal the OBS update weights H^-1[i, j>i] are zero: no error feedback."""
    torch.manual_seed(1)
    w = torch.randn(16, 48)
    h = torch.diag(torch.rand(48) + 0.5)
    q, s = gptq_fp8_quantize(w, h, mse_scale=False)
    q0, s0 = quantize_fp8(w)
    assert torch.equal(q.float(), q0.float()) and torch.equal(s, s0)
    q, s = gptq_fp8_quantize(w, h)  # searched scales: still nearest E4M3 of w / s, row by row
    assert torch.equal(q.float(), round_fp8(w / s[:, None]))


def test_fp8_mse_scales_are_the_best_candidate():
    torch.manual_seed(4)
    w = torch.randint(-8, 8, (32, 64)).float() * 0.013 + 0.002  # weights on a coarse grid
    imp = torch.rand(64) + 0.1
    s = fp8_mse_scales(w, imp)
    err = lambda sc: ((round_fp8(w / sc[:, None]) * sc[:, None] - w) ** 2 * imp).sum(1)  # noqa: E731
    for step in SCALE_STEPS:  # brute force over the candidates
        assert (err(s) <= err(fp8_scales(w) * step) * (1 + 1e-6)).all()
    assert (err(s) < err(fp8_scales(w))).any()


def test_gptq_fp8_beats_rounding_on_correlated_inputs():
    torch.manual_seed(2)
    k, n = 128, 64
    mix = torch.randn(k, k) / k ** 0.5 + torch.eye(k)
    x = torch.randn(2048, k) @ mix
    w = torch.randn(n, k)
    acc = HessianAccumulator(k)
    acc.add(x[:1024])
    rtn = dequantize_fp8(*quantize_fp8(w))
    gptq = dequantize_fp8(*gptq_fp8_quantize(w, acc.hessian()))
    # held-out tokens (x[1024:]) so the win is not just fitting the calibration set
    assert _output_error(w, gptq, x[1024:]) < 0.8 * _output_error(w, rtn, x[1024:])


def test_gptq_fp8_rejects_wrong_hessian():
    with pytest.raises(ValueError, match="hessian"):
        gptq_fp8_quantize(torch.randn(4, 8), torch.eye(7))


@pytest.mark.slow
def test_gptq_fp8_beats_rounding_on_real_smollm2_layer(smollm2_layer0_qkv):
    """Layer 0's qkv_proj of SmolLM2 with its real inputs (RMSNorm(embeddings) * weight):
    calibration text for H, the evaluation text to measure."""
    w, hessian, x_test = smollm2_layer0_qkv
    rtn = dequantize_fp8(*quantize_fp8(w))
    plain = dequantize_fp8(*gptq_fp8_quantize(w, hessian, mse_scale=False))
    gptq = dequantize_fp8(*gptq_fp8_quantize(w, hessian))
    assert _output_error(w, plain, x_test) < 0.8 * _output_error(w, rtn, x_test)
    assert _output_error(w, gptq, x_test) < _output_error(w, plain, x_test)
