"""Paged attention (reference and the batched CPU path) equals dense causal attention computed
here in float64 from contiguous K/V, on mixed decode / prefill / chunked-prefill batches."""
import random

import pytest
import torch

from tritium.kernels.attention_metadata import AttentionMetadata
from tritium.kernels.kv_write_ref import dequantize_kv_ref, quantize_kv_ref
from tritium.kernels.attention_cpu import paged_attention_cpu
from tritium.kernels.attention_ref import paged_attention_ref


def dense(q, k, v, qlen, scale, window):
    """q (qlen, Hq, D), k/v (slen, Hkv, D): the last qlen positions attend causally (and in window)."""
    slen, hkv = k.shape[0], k.shape[1]
    rep = q.shape[1] // hkv
    k = k.double().repeat_interleave(rep, dim=1)
    v = v.double().repeat_interleave(rep, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    qpos = torch.arange(slen - qlen, slen)[:, None]
    kpos = torch.arange(slen)[None, :]
    ok = kpos <= qpos
    if window is not None:
        ok &= qpos - kpos < window
    s = s.masked_fill(~ok, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


def make_case(seed, hq, hkv, d, bs, window, kv_dtype=None, dtype=torch.float32):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    # (query_len, seq_len): decodes, a full prefill, chunked prefills with context, a 1-token prompt.
    shapes = [(1, rng.randint(1, 50)) for _ in range(5)] + [(17, 17), (5, 40), (9, 23), (1, 1), (30, 61)]
    rng.shuffle(shapes)
    num_blocks = sum(-(-s // bs) for _, s in shapes) + 3
    perm = list(range(num_blocks))
    rng.shuffle(perm)
    cdt = kv_dtype or dtype
    k_cache = torch.zeros(num_blocks, bs, hkv, d, dtype=cdt)
    v_cache = torch.zeros_like(k_cache)
    k_scale = v_scale = None
    if kv_dtype is not None:
        k_scale = torch.rand(hkv) * 0.05 + 0.01
        v_scale = torch.rand(hkv) * 0.05 + 0.01
    tables, qs, dense_kv = [], [], []
    for qlen, slen in shapes:
        nb = -(-slen // bs)
        table = [perm.pop() for _ in range(nb)]
        k = torch.randn(slen, hkv, d, dtype=dtype)
        v = torch.randn(slen, hkv, d, dtype=dtype)
        if kv_dtype is not None:
            kq, vq = quantize_kv_ref(k, k_scale, kv_dtype), quantize_kv_ref(v, v_scale, kv_dtype)
            k, v = dequantize_kv_ref(kq, k_scale, dtype), dequantize_kv_ref(vq, v_scale, dtype)
        else:
            kq, vq = k, v
        for pos in range(slen):
            k_cache[table[pos // bs], pos % bs] = kq[pos]
            v_cache[table[pos // bs], pos % bs] = vq[pos]
        tables.append(table)
        qs.append(torch.randn(qlen, hq, d, dtype=dtype))
        dense_kv.append((k, v))
    meta = AttentionMetadata.build([s[0] for s in shapes], [s[1] for s in shapes], tables, bs)
    return shapes, torch.cat(qs), qs, dense_kv, k_cache, v_cache, meta, k_scale, v_scale


@pytest.mark.parametrize("impl", [paged_attention_ref, paged_attention_cpu])
@pytest.mark.parametrize("hq,hkv,d,bs,window", [(6, 2, 16, 4, None), (4, 1, 18, 8, None), (3, 3, 8, 16, None),
                                                 (6, 3, 16, 4, 7)])
def test_paged_equals_dense(impl, hq, hkv, d, bs, window):
    shapes, q, qs, kv, kc, vc, meta, ks, vs = make_case(hq * 7 + bs, hq, hkv, d, bs, window)
    out = impl(q, kc, vc, meta, d ** -0.5, window)
    start = 0
    for (qlen, _), qb, (k, v) in zip(shapes, qs, kv):
        ref = dense(qb, k, v, qlen, d ** -0.5, window)
        torch.testing.assert_close(out[start:start + qlen].double(), ref, atol=1e-5, rtol=1e-5)
        start += qlen


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn])
def test_quantized_kv_cache(kv_dtype):
    shapes, q, qs, kv, kc, vc, meta, ks, vs = make_case(3, 6, 2, 16, 4, None, kv_dtype=kv_dtype)
    out = paged_attention_cpu(q, kc, vc, meta, 0.25, None, ks, vs)
    start = 0
    for (qlen, _), qb, (k, v) in zip(shapes, qs, kv):
        torch.testing.assert_close(out[start:start + qlen].double(), dense(qb, k, v, qlen, 0.25, None),
                                   atol=1e-4, rtol=1e-4)
        start += qlen


def test_bf16_within_tolerance():
    shapes, q, qs, kv, kc, vc, meta, _, _ = make_case(5, 6, 2, 16, 4, None, dtype=torch.bfloat16)
    out = paged_attention_cpu(q, kc, vc, meta, 0.25)
    start = 0
    for (qlen, _), qb, (k, v) in zip(shapes, qs, kv):
        # bf16 inputs and output: 8 mantissa bits -> ~4e-3 relative rounding of O(1) outputs.
        torch.testing.assert_close(out[start:start + qlen].double(), dense(qb, k, v, qlen, 0.25, None),
                                   atol=2e-2, rtol=2e-2)
        start += qlen


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("sdpa_mask_max", [0, 1 << 24])
def test_small_tiles_and_groups(monkeypatch, window, sdpa_mask_max):
    # Force several decode groups, and either the tiled prefill (several tiles per sequence:
    # causal key ranges, window lower bounds) or SDPA for every prefill row.
    import tritium.kernels.attention_cpu as pa
    monkeypatch.setattr(pa, "SDPA_MASK_MAX", sdpa_mask_max)
    monkeypatch.setattr(pa, "PREFILL_TILE", 4)
    monkeypatch.setattr(pa, "DECODE_GROUP", 2)
    shapes, q, qs, kv, kc, vc, meta, _, _ = make_case(9, 6, 2, 16, 4, window)
    out = pa.paged_attention_cpu(q, kc, vc, meta, 0.25, window)
    start = 0
    for (qlen, _), qb, (k, v) in zip(shapes, qs, kv):
        torch.testing.assert_close(out[start:start + qlen].double(), dense(qb, k, v, qlen, 0.25, window),
                                   atol=1e-5, rtol=1e-5)
        start += qlen


def test_decode_grouping_is_the_cheapest_contiguous_partition():
    """partition_sorted against brute force over every way to cut sorted rows into groups."""
    import itertools

    from tritium.kernels.attention_cpu import partition_sorted
    rng = random.Random(7)
    for _ in range(30):
        n = rng.randint(1, 8)
        lens = sorted(rng.choice([16, 32, 48, 256, 512, 800]) for _ in range(n))
        overhead, max_group = rng.choice([0, 64, 768]), rng.randint(1, 4)

        def cost(groups):
            return sum(overhead + (b - a) * lens[b - 1] for a, b in groups)

        best = None
        for cuts in itertools.product([False, True], repeat=n - 1):
            bounds = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [n]
            groups = list(zip(bounds, bounds[1:]))
            if all(b - a <= max_group for a, b in groups):
                best = cost(groups) if best is None else min(best, cost(groups))
        got = partition_sorted(lens, overhead, max_group)
        assert [a for a, _ in got] == [0] + [b for _, b in got][:-1] and got[-1][1] == n  # a partition
        assert all(b - a <= max_group for a, b in got)
        assert cost(got) == best


@pytest.mark.parametrize("hq,hkv,d,bs,window", [(9, 3, 64, 16, None), (8, 1, 32, 4, None), (4, 4, 128, 8, 6),
                                                 (16, 2, 64, 16, 13)])
def test_native_bf16_decode_matches_dense(hq, hkv, d, bs, window, cpu_path):
    """The native decode kernel of each CPU path (bf16 cache) on a mixed batch: its decode rows,
    and the prefill rows torch computes beside them, against float64 attention."""
    from tritium.kernels import cpu_native
    seed = random.randrange(1 << 30)
    shapes, q, qs, kv, kc, vc, meta, _, _ = make_case(seed, hq, hkv, d, bs, window, dtype=torch.bfloat16)
    assert cpu_native.decode_supported(q, kc, None)
    out = paged_attention_cpu(q, kc, vc, meta, d ** -0.5, window)
    start = 0
    for (qlen, _), qb, (k, v) in zip(shapes, qs, kv):
        torch.testing.assert_close(out[start:start + qlen].double(), dense(qb, k, v, qlen, d ** -0.5, window),
                                   atol=2e-2, rtol=2e-2, msg=lambda m: f"seed={seed}: {m}")
        start += qlen
