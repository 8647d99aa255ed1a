"""Attention-weighted KV offsets (builder/kv_scales.attention_weighted_offsets): the attention each
calibration key receives, accumulated by the calibration hook, against an explicit per-query
softmax; and the offset's defining property (least attention-weighted squared distance)."""
from __future__ import annotations

import torch

from tritium.builder.calibration import _accumulate_attention
from tritium.builder.quant.kv_scales import attention_weighted_offsets
from tritium.kernels.rotary_ref import rope_cos_sin_cache, rope_inv_freq


def _rope(x, pos, theta=10000.0):
    """Rotate-half RoPE written out from its definition (x: (T, H, D))."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.double()[:, None] * inv[None, :]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None], torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    x1, x2 = x.double()[..., : d // 2], x.double()[..., d // 2:]
    return x.double() * cos + torch.cat([-x2, x1], -1) * sin


def test_attention_received_matches_explicit_softmax():
    torch.manual_seed(0)
    hq, hkv, d, lens = 4, 2, 8, (5, 7)
    t = sum(lens)
    q, k, v = torch.randn(t, hq, d), torch.randn(t, hkv, d), torch.randn(t, hkv, d)
    positions = torch.cat([torch.arange(n) for n in lens])
    cache = rope_cos_sin_cache(rope_inv_freq(d, 10000.0), 64)
    stats: dict = {}
    _accumulate_attention(stats, q, k, v, positions, cache, d ** -0.5)
    # oracle: loop over sequences, query heads and queries
    w = torch.zeros(hkv, dtype=torch.float64)
    kw = torch.zeros(hkv, d, dtype=torch.float64)
    vw = torch.zeros(hkv, d, dtype=torch.float64)
    a = 0
    for n in lens:
        qr, kr = _rope(q[a:a + n], positions[a:a + n]), _rope(k[a:a + n], positions[a:a + n])
        for h in range(hq):
            g = h // (hq // hkv)
            for i in range(n):
                p = torch.softmax((kr[: i + 1, g] @ qr[i, h]) * d ** -0.5, dim=0)
                w[g] += p.sum()
                kw[g] += p @ kr[: i + 1, g]
                vw[g] += p @ v[a:a + i + 1, g].double()
        a += n
    # every query spreads weight 1 over its keys: the total is (number of queries) x (q heads per kv head)
    assert torch.allclose(w, torch.full((hkv,), float(t * hq // hkv), dtype=torch.float64))
    assert torch.allclose(stats["w"].double(), w, atol=1e-4)
    assert torch.allclose(attention_weighted_offsets(stats, "k").double(), kw / w[:, None], atol=1e-4)
    assert torch.allclose(attention_weighted_offsets(stats, "v").double(), vw / w[:, None], atol=1e-4)


def test_weighted_offset_minimises_weighted_squared_distance():
    torch.manual_seed(1)
    x = torch.randn(50, 2, 4)
    p = torch.rand(50, 2)
    stats = {"w": p.sum(0), "kw": torch.einsum("sh,shd->hd", p, x)}
    c = attention_weighted_offsets(stats, "k")

    def cost(c):
        return (p[..., None] * (x - c) ** 2).sum()
    base = cost(c)
    for _ in range(20):
        assert cost(c + 0.05 * torch.randn_like(c)) > base
    assert cost(x.mean(0)) > base  # the plain mean is not the weighted optimum here
