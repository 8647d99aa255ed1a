"""GPTQ and AWQ against their papers' claims, with RTN (the baseline) as the comparison:
GPTQ lowers the layer output error ||WX - QX|| on a real SmolLM2 layer, AWQ's search picks a
non-trivial scale when some input channels carry outliers."""
from __future__ import annotations

import pytest
import torch

from tritium.builder.awq import awq_search_scale, fake_quantize_int4, pooled_head_stat
from tritium.builder.gptq import HessianAccumulator, gptq_quantize
from tritium.builder.quantize_int4 import quantize_int4
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
