"""KV-cache scales against their definitions, with the runtime's own KV quantizer
(kernels/kv_write_ref.py) as the oracle for what a scale costs: FP8 scales are headroom x amax / 448
and never saturate the calibration values; INT8 scales are the MSE-best clip of the candidate
grid; calibration K is rotated at positions drawn over the whole RoPE table."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tritium.builder.calibration import kv_sample_hook
from tritium.builder.quant.kv_scales import FP8_HEADROOM, INT8_CLIP_RATIOS, kv_head_scales
from tritium.kernels.kv_write_ref import dequantize_kv_ref, quantize_kv_ref
from tritium.kernels.rotary_ref import rope_cos_sin_cache, rope_inv_freq, rotary_ref


def _stored_error(x, scale, dtype):
    """Squared error per head of x (T, H, D) written to a `dtype` cache and read back."""
    back = dequantize_kv_ref(quantize_kv_ref(x, scale, dtype), scale, torch.float32)
    return (back - x).pow(2).sum(dim=(0, 2))


def _heads_with_outliers(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3000, 3, 16, generator=g)
    x[5, 0, 3] = 40.0    # head 0: one far outlier, clipping it pays
    x[:, 2] *= 0.01      # head 2: small values, still a positive scale
    return x


def test_fp8_scales_are_headroom_amax_and_do_not_saturate():
    x = _heads_with_outliers(0)
    s = kv_head_scales(x, "fp8")
    assert s.dtype == torch.float32 and s.shape == (3,)
    assert torch.allclose(s, x.abs().amax(dim=(0, 2)) * FP8_HEADROOM / 448.0)
    q = quantize_kv_ref(x, s, torch.float8_e4m3fn).float()
    assert q.abs().max() <= 448.0 / FP8_HEADROOM  # the calibration values stay below 448 / headroom
    back = dequantize_kv_ref(q.to(torch.float8_e4m3fn), s, torch.float32)
    normal = x.abs() >= s[None, :, None] * 2.0 ** -6  # E4M3 normals: relative error <= 2^-4
    assert ((back - x).abs() <= x.abs() * 2.0 ** -4 + 1e-12)[normal].all()


def test_int8_scales_are_the_mse_best_clip():
    x = _heads_with_outliers(1)
    s = kv_head_scales(x, "int8")
    amax = x.abs().amax(dim=(0, 2))
    got = _stored_error(x, s, torch.int8)
    for r in INT8_CLIP_RATIOS:  # brute force over the same candidates, with the runtime quantizer
        assert (got <= _stored_error(x, amax * r / 127.0, torch.int8) * (1 + 1e-5)).all()
    assert s[0] < 0.9 * amax[0] / 127.0           # the lone outlier is clipped
    assert (got < _stored_error(x, amax / 127.0, torch.int8)).all()
    assert (s > 0).all()


def test_int8_without_outliers_keeps_nearly_all_the_range():
    x = torch.rand(4000, 2, 8, generator=torch.Generator().manual_seed(2)) * 2 - 1  # uniform: no tail
    s = kv_head_scales(x, "int8")
    assert (s >= 0.95 * x.abs().amax(dim=(0, 2)) / 127.0).all()


def test_zero_head_and_bad_dtype():
    x = torch.zeros(10, 2, 4)
    for dt in ("fp8", "int8"):
        assert (kv_head_scales(x, dt) > 0).all()
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_head_scales(x, "int4")


def test_kv_sample_hook_rotates_k_over_the_whole_table():
    hq, hkv, d, t, max_pos = 4, 2, 8, 64, 4096
    layer = SimpleNamespace(num_heads=hq, num_kv_heads=hkv, head_dim=d)
    cs = rope_cos_sin_cache(rope_inv_freq(d, 10000.0, "default", 1.0, 1.0, 4.0, None), max_pos)
    out = torch.randn(t, (hq + 2 * hkv) * d, generator=torch.Generator().manual_seed(3))
    stats: dict = {}
    hook = kv_sample_hook(layer, cs, stats, seed=7)
    hook(None, None, out)
    hook(None, None, out)
    k_pre = out[:, hq * d:(hq + hkv) * d].reshape(t, hkv, d)
    v = out[:, (hq + hkv) * d:].reshape(t, hkv, d)
    assert len(stats["k"]) == len(stats["v"]) == 2
    assert torch.equal(stats["v"][0], v)
    # RoPE is a rotation of each (i, i + D/2) pair: norms are kept whatever the positions
    pair_norm = lambda x: x[..., :d // 2].pow(2) + x[..., d // 2:].pow(2)  # noqa: E731
    assert torch.allclose(pair_norm(stats["k"][0]), pair_norm(k_pre), atol=1e-5)
    # the positions are a seeded uniform draw over the table, fresh for each chunk
    gen = torch.Generator().manual_seed(7)
    for chunk in range(2):
        pos = torch.randint(0, max_pos, (t,), generator=gen)
        q = torch.zeros(t, hq, d)
        assert torch.allclose(stats["k"][chunk], rotary_ref(q, k_pre, pos, cs)[1], atol=1e-6)
    assert pos.max() > t  # beyond the chunk's own positions 0..t-1
