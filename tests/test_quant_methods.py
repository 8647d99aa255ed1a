"""GPTQ and AWQ against their papers' claims, with RTN (the baseline) as the comparison:
GPTQ lowers the layer output error ||WX - QX|| on a real SmolLM2 layer, AWQ's search picks a
non-trivial scale when some input channels carry outliers."""
from __future__ import annotations

import pytest
import torch

from tritium.builder.quant.awq import (awq_clip_int4, awq_search, awq_search_scale, fake_quantize_int4,
                                       group_weight_mean, hessian_loss, pooled_head_stat)
from tritium.builder.quant.quantize_int4 import int4_codes, int4_params
from tritium.builder.quant.gptq import HessianAccumulator, gptq_quantize
from tritium.builder.quant.quantize_int4 import quantize_int4
from tritium.kernels.quant_layouts import dequantize_int4


def _output_error(w, deq, x):
    return ((x @ (w - deq).t()).norm() / (x @ w.t()).norm()).item()


def test_gptq_beats_rtn_on_synthetic_correlated_inputs():
    torch.manual_seed(0)
    k, n = 128, 64
    mix = torch.randn(k, k) / k ** 0.5 + torch.eye(k)
    x = torch.randn(2048, k) @ mix  # correlated features, as real activations are
    w = torch.randn(n, k)
    acc = HessianAccumulator(k)
    acc.add(x[:1024])
    rtn = dequantize_int4(*quantize_int4(w, 32), 32)
    for act_order in (False, True):
        qw, s, z, g_idx = gptq_quantize(w, acc.hessian(), 32, act_order=act_order)
        assert (g_idx is not None) == act_order
        if act_order:  # every group holds exactly group_size channels
            assert torch.equal(torch.bincount(g_idx.long()), torch.full((k // 32,), 32))
        deq = dequantize_int4(qw, s, z, 32, g_idx)
        # held-out tokens (x[1024:]) so the win is not just fitting the calibration set
        assert _output_error(w, deq, x[1024:]) < 0.9 * _output_error(w, rtn, x[1024:])


@pytest.mark.slow
def test_gptq_beats_rtn_on_real_smollm2_layer(smollm2_layer0_qkv):
    """Layer 0's qkv_proj of SmolLM2 with its real inputs: RMSNorm(embeddings of text) * weight."""
    w, hessian, x_test = smollm2_layer0_qkv
    rtn = dequantize_int4(*quantize_int4(w, 64), 64)
    qw, s, z, g_idx = gptq_quantize(w, hessian, 64)
    gptq = dequantize_int4(qw, s, z, 64, g_idx)
    assert _output_error(w, gptq, x_test) < 0.95 * _output_error(w, rtn, x_test)


def test_awq_picks_nontrivial_scale_with_outlier_channels():
    torch.manual_seed(1)
    k, n = 256, 96
    x = torch.randn(1024, k)
    outliers = torch.tensor([3, 50, 77, 200])
    x[:, outliers] *= 40.0  # a few channels with large activations (the paper's observation)
    w = torch.randn(n, k)
    s, alpha, losses = awq_search_scale([w], x[:512], x[:512].abs().mean(0), group_size=64)
    assert alpha > 0.0                      # alpha = 0 would be plain RTN
    assert min(losses) < 0.8 * losses[0]
    assert s[outliers].min() > s[[i for i in range(k) if i not in set(outliers.tolist())]].max()
    # and the win holds on tokens the search did not see
    rtn = fake_quantize_int4(w, 64)
    awq = fake_quantize_int4(w * s, 64) / s
    held = x[512:]
    assert _output_error(w, awq, held) < _output_error(w, rtn, held)


def test_awq_no_outliers_stays_close_to_rtn():
    torch.manual_seed(2)
    x = torch.randn(1024, 128)
    w = torch.randn(32, 128)
    s, _, losses = awq_search_scale([w], x[:512], x[:512].abs().mean(0), group_size=32)
    assert min(losses) > 0.95 * losses[0]     # with no salient channels no scaling pays much
    rtn = fake_quantize_int4(w, 32)
    awq = fake_quantize_int4(w * s, 32) / s
    held = x[512:]
    assert _output_error(w, awq, held) <= 1.05 * _output_error(w, rtn, held)


def test_pooled_head_stat_shares_scale_within_kv_group():
    stat = torch.rand(6 * 4)  # 6 query heads of dim 4, 2 KV heads
    pooled = pooled_head_stat(stat, num_heads=6, num_kv_heads=2, head_dim=4).view(2, 3, 4)
    assert torch.allclose(pooled, pooled[:, :1].expand(2, 3, 4))
    assert torch.allclose(pooled[:, 0], stat.view(2, 3, 4).mean(1))


def _outlier_inputs(seed, k=256, n_tokens=2048):
    torch.manual_seed(seed)
    x = torch.randn(n_tokens, k)
    x[:, torch.tensor([3, 50, 77, 200]) % k] *= 40.0
    return x


def test_hessian_loss_is_the_output_error_over_the_tokens():
    x = _outlier_inputs(3, k=64, n_tokens=300)
    d = torch.randn(16, 64)
    assert hessian_loss(d, x.t() @ x) == pytest.approx((x @ d.t()).pow(2).sum().item(), rel=1e-4)


def test_awq_search_scores_every_token_and_never_loses_to_rtn():
    x = _outlier_inputs(4)
    w = torch.randn(96, 256)
    cal, held = x[:1024], x[1024:]
    choice = awq_search([w[:40], w[40:]], cal.t() @ cal, cal.abs().mean(0), group_size=64)
    s = choice.scales
    deq = fake_quantize_int4(w * s, 64) / s
    # the reported loss is the output error of the chosen scales on all calibration tokens
    assert choice.loss == pytest.approx((cal @ (deq - w).t()).pow(2).sum().item(), rel=1e-3)
    rtn = fake_quantize_int4(w, 64)
    assert choice.rtn_loss == pytest.approx((cal @ (rtn - w).t()).pow(2).sum().item(), rel=1e-3)
    assert choice.loss < 0.8 * choice.rtn_loss and choice.alpha > 0
    assert _output_error(w, deq, held) < _output_error(w, rtn, held)


def test_awq_search_duo_scales_follow_their_definition():
    """Duo scaling (AutoAWQ / llm-compressor): s = x^a / w^(1-a), w the mean of |w| over its
    group's max; centred so max(s) min(s) = 1."""
    x = _outlier_inputs(5)
    w = torch.randn(64, 256) * torch.linspace(0.2, 3.0, 256)  # input channels of unequal size
    H, xs = x.t() @ x, x.abs().mean(0)
    choice = awq_search([w], H, xs, group_size=64, duo=True)
    a = choice.alpha
    wg = w.abs().reshape(64, 4, 64)
    w_hat = (wg / wg.amax(-1, keepdim=True)).reshape(64, 256).mean(0)
    assert torch.allclose(group_weight_mean(w, 64), w_hat)
    expect = xs.pow(a) / w_hat.pow(1 - a) if choice.duo else xs.pow(a)
    expect = expect / (expect.max() * expect.min()).sqrt()
    assert torch.allclose(choice.scales, expect, rtol=1e-5)
    # the duo grid contains the plain one, so with it the search can only do better
    plain = awq_search([w], H, xs, group_size=64, duo=False)
    assert choice.loss <= plain.loss and plain.duo is False


def test_awq_clip_picks_each_groups_best_ratio():
    """Oracle: for every (row, group), the clip ratio r of the paper's search (clamp to r * amax,
    then min/max) with the least output error, measured directly on the tokens."""
    x = _outlier_inputs(6, k=128, n_tokens=512)
    w = torch.randn(8, 128)
    w[:, 5] *= 6.0  # an outlier weight column makes clipping pay in its groups
    ratios = (1.0, 0.9, 0.8, 0.7, 0.6)
    clip_rows = torch.tensor([True] * 6 + [False] * 2)
    scale, zero = awq_clip_int4(w, x.t() @ x, 32, ratios=ratios, clip_rows=clip_rows)
    clipped_any = False
    for n in range(8):
        for g in range(4):
            wg, xg = w[n, g * 32:(g + 1) * 32], x[:, g * 32:(g + 1) * 32]
            errs = []
            for r in ratios:
                amax = wg.abs().max()
                s, z = int4_params(wg.clamp(-r * amax, r * amax))
                deq = (int4_codes(wg, s, z) - 8) * s + z
                errs.append(((xg @ (deq - wg)).pow(2).sum().item(), s.item(), z.item()))
            best = min(errs[:1] if n >= 6 else errs, key=lambda e: e[0])
            assert scale[n, g].item() == pytest.approx(best[1], rel=1e-4), (n, g)
            assert zero[n, g].item() == pytest.approx(best[2], rel=1e-4, abs=1e-6), (n, g)
            clipped_any |= best is not errs[0]
    assert clipped_any  # the test would be vacuous if r = 1 always won
