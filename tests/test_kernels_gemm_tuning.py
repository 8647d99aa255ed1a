"""GEMM tuning (kernels/gemm_tuning.py): row buckets, every config of every space and every
split-K count against the torch references of gemm_ref.py under the interpreter, and the
load-time warm-up visiting every (row bucket, N, K) of a model's quantized linears.
"""
from __future__ import annotations

import kernel_env  # noqa: F401  (must precede the kernel imports: sets TRITON_INTERPRET=1)
import pytest
import torch
from kernel_env import assert_close, new_rng

from tritium.kernels import gemm_ref, gemm_tuning, gemm_triton
from tritium.kernels.gemm_tuning import LARGE, ROW_BUCKETS, SPACES, GemmConfig, row_bucket


def test_row_bucket_boundaries():
    want = {1: 1, 2: 4, 4: 4, 5: 8, 8: 8, 9: 16, 16: 16, 17: 32, 32: 32, 33: 64, 64: 64, 65: LARGE, 4096: LARGE}
    assert {m: row_bucket(m) for m in want} == want
    with pytest.raises(ValueError, match="m:"):
        row_bucket(0)
    # off CUDA: one fixed config per bucket, from the kernel's own space
    for kernel, space in SPACES.items():
        for m in (1, 3, 16, 20, 40, 100):
            assert gemm_tuning.default_config(kernel, m) in space
            assert gemm_tuning.default_config(kernel, m).split_k == 1


def test_split_ranges_cover_k_without_empty_splits():
    for k in (16, 48, 100, 256, 4096, 4100):
        for bk in (16, 32, 64, 128):
            for s in (1, 2, 3, 4, 8, 64):
                splits, per = gemm_tuning.split_ranges(k, bk, s)
                assert per % bk == 0 and 1 <= splits <= s
                assert (splits - 1) * per < k <= splits * per


def _force(monkeypatch, cfg: GemmConfig):
    monkeypatch.setattr(gemm_triton.CACHE, "pick", lambda *a, **kw: cfg)


def _int4(n, k, group, act_order):
    qweight = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    scales = torch.rand(k // group, n) * 0.02 + 1e-3
    zeros = torch.randn(k // group, n) * 0.01
    g_idx = None
    if act_order:
        perm = torch.randperm(k)
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[perm] = (torch.arange(k) // group).int()
    return qweight, scales, zeros, g_idx


@pytest.mark.parametrize("cfg", SPACES["w4a16"], ids=str)
def test_every_w4a16_config_matches_reference(monkeypatch, cfg):
    rng, seed = new_rng()
    _force(monkeypatch, cfg)
    for group, act_order in ((32, False), (48, False), (64, True)):
        m, n, k = rng.choice([1, 5, 17]), rng.choice([40, 72]), group * rng.randint(2, 4)
        qw, s, z, g_idx = _int4(n, k, group, act_order)
        x, bias = torch.randn(m, k).to(torch.bfloat16), torch.randn(n).to(torch.bfloat16)
        got = gemm_triton.w4a16_gemm(x, qw, s, z, group, g_idx, bias)
        ref = gemm_ref.w4a16_gemm_ref(x, qw, s, z, group, g_idx, bias)
        assert_close(got, ref, torch.bfloat16, f"seed={seed} {cfg} m={m} n={n} k={k} G={group}")


@pytest.mark.parametrize("cfg", SPACES["w8a16"], ids=str)
def test_every_w8a16_config_matches_reference(monkeypatch, cfg):
    rng, seed = new_rng()
    _force(monkeypatch, cfg)
    m, n, k = rng.choice([1, 6, 19]), rng.choice([24, 72]), 16 * rng.randint(3, 12)
    x = torch.randn(m, k).to(torch.float16)
    qw = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    sc = torch.rand(n) * 0.01
    assert_close(gemm_triton.w8a16_gemm(x, qw, sc), gemm_ref.w8a16_gemm_ref(x, qw, sc), torch.float16,
                 f"seed={seed} {cfg} per-channel m={m} n={n} k={k}")
    g = 32
    k = g * rng.randint(2, 5)
    x = torch.randn(m, k).to(torch.float16)
    qw = (torch.randn(n, k) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    sg, zg = torch.rand(k // g, n) * 0.01, torch.randn(k // g, n) * 0.01
    assert_close(gemm_triton.w8a16_gemm(x, qw, sg, zeros=zg, group_size=g),
                 gemm_ref.w8a16_gemm_ref(x, qw, sg, None, zg, g), torch.float16,
                 f"seed={seed} {cfg} grouped fp8 m={m} n={n} k={k}")


@pytest.mark.parametrize("cfg", SPACES["fp8"], ids=str)
def test_every_fp8_config_matches_reference(monkeypatch, cfg):
    rng, seed = new_rng()
    _force(monkeypatch, cfg)
    m, n, k = rng.choice([1, 7, 21]), rng.choice([40, 72]), 16 * rng.randint(3, 12)
    w = torch.randn(n, k)
    scales = w.abs().amax(dim=1) / 448.0
    qw = (w / scales[:, None]).to(torch.float8_e4m3fn)
    x, bias = torch.randn(m, k), torch.randn(n)
    assert_close(gemm_triton.fp8_gemm(x, qw, scales, bias), gemm_ref.fp8_gemm_ref(x, qw, scales, bias),
                 torch.float32, f"seed={seed} {cfg} m={m} n={n} k={k}")


@pytest.mark.parametrize("split", (1, 2, 3, 5, 8))
def test_split_k_every_split_odd_shapes(monkeypatch, split):
    """Odd M, N and K (K not a multiple of the K tile), every kernel, float32 exactness."""
    rng, seed = new_rng()
    _force(monkeypatch, GemmConfig(16, 32, 32, split_k=split))
    m, n = rng.choice([1, 3, 7]), rng.choice([13, 37])
    k = 2 * rng.randint(40, 120)  # even for int4, rarely a multiple of 32
    x = torch.randn(m, k)
    qw4, s4, z4, _ = _int4(n, k, k // 2 if (k // 2) % 2 == 0 else k, False)
    g4 = k // 2 if (k // 2) % 2 == 0 else k
    assert_close(gemm_triton.w4a16_gemm(x, qw4, s4, z4, g4), gemm_ref.w4a16_gemm_ref(x, qw4, s4, z4, g4),
                 torch.float32, f"seed={seed} w4a16 split={split} m={m} n={n} k={k}")
    qw8, s8 = torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n) * 0.01
    bias = torch.randn(n)
    assert_close(gemm_triton.w8a16_gemm(x, qw8, s8, bias), gemm_ref.w8a16_gemm_ref(x, qw8, s8, bias),
                 torch.float32, f"seed={seed} w8a16 split={split} m={m} n={n} k={k}")
    w = torch.randn(n, k)
    sf = w.abs().amax(dim=1) / 448.0
    qf = (w / sf[:, None]).to(torch.float8_e4m3fn)
    assert_close(gemm_triton.fp8_gemm(x, qf, sf, bias), gemm_ref.fp8_gemm_ref(x, qf, sf, bias),
                 torch.float32, f"seed={seed} fp8 split={split} m={m} n={n} k={k}")


def test_split_k_is_run_to_run_identical(monkeypatch):
    _force(monkeypatch, GemmConfig(16, 32, 32, split_k=4))
    x = torch.randn(3, 256)
    qw, s = torch.randint(-127, 128, (40, 256), dtype=torch.int8), torch.rand(40) * 0.01
    a, b = gemm_triton.w8a16_gemm(x, qw, s), gemm_triton.w8a16_gemm(x, qw, s)
    assert torch.equal(a, b)


def test_warm_up_visits_every_bucket_of_every_linear(monkeypatch):
    """The load-time warm-up asks the config cache for every (row bucket, N, K) of a model's
    quantized linears (int4, int8, grouped int8, fp8, the int6 head: its codes widened to int8),
    the keys that serving will ask for."""
    from tritium.backend.gemm_warmup import warm_up_gemms
    from tritium.backend.quant import Fp8Linear, Int4Linear, Int6Linear, Int8Linear
    from types import SimpleNamespace as NS
    monkeypatch.setenv("TRITIUM_KERNELS", "triton")
    monkeypatch.setattr(gemm_triton, "CACHE", gemm_tuning.ConfigCache())
    model = torch.nn.Sequential(
        Int4Linear(64, 48, False, torch.float32, NS(group_size=32, act_order=False)),
        Int8Linear(64, 32, False, torch.float32, NS(group_size=None)),
        Int8Linear(32, 64, False, torch.float32, NS(group_size=16, asymmetric=True)),
        Fp8Linear(64, 16, False, torch.float32, NS(group_size=None)),
        Int4Linear(64, 48, False, torch.float32, NS(group_size=32, act_order=False)),  # same shape: once
        Int6Linear(64, 40, False, torch.float32, NS(group_size=32)),  # qweight as stored: uint8 (40, 48)
    )
    for mod in model:
        for name, buf in mod.named_buffers():
            if buf.dtype == torch.float32:
                buf.copy_(torch.rand_like(buf) * 0.01)
            elif buf.dtype == torch.float8_e4m3fn:
                buf.copy_(torch.randn(buf.shape).to(buf.dtype))
            else:
                buf.zero_()
    runs = warm_up_gemms(model, torch.float32, max_rows=80)
    shapes = {("w4a16", 48, 64), ("w8a16", 32, 64), ("w8a16", 64, 32), ("fp8", 16, 64), ("w8a16", 40, 64)}
    visited = {(key[0], key[2], key[3], key[4]) for key in gemm_triton.CACHE.visited}
    want = {(kern, b, n, k) for kern, n, k in shapes for b in ROW_BUCKETS}
    assert visited == want, sorted(want ^ visited)
    assert runs == len(shapes) * len(ROW_BUCKETS)
    # a step that never exceeds 8 rows warms buckets 1, 2-4 and 5-8 only
    gemm_triton.CACHE.visited.clear()
    assert warm_up_gemms(model, torch.float32, max_rows=8) == len(shapes) * 3
    assert {key[2] for key in gemm_triton.CACHE.visited} == {1, 4, 8}


def test_batch_invariant_cache_keeps_the_bucket_defaults(monkeypatch):
    """A deterministic engine's flag: no timing, the default of the bucket, even where tuning runs."""
    cache = gemm_tuning.ConfigCache()
    monkeypatch.setattr(gemm_tuning, "tuning_enabled", lambda device: True)
    timed = []
    monkeypatch.setattr(gemm_tuning.ConfigCache, "_tune", staticmethod(lambda kernel, launch: timed.append(kernel)
                                                                          or GemmConfig(16, 64, 64, split_k=4)))
    cache.batch_invariant = True
    assert cache.pick("w4a16", (), 3, 64, 64, torch.device("cpu"), None) == gemm_tuning.default_config("w4a16", 3)
    assert timed == []
    cache.batch_invariant = False
    assert cache.pick("w4a16", (), 3, 64, 64, torch.device("cpu"), None).split_k == 4
    assert cache.pick("w4a16", (), 4, 64, 64, torch.device("cpu"), None).split_k == 4  # same bucket: cached
    assert timed == ["w4a16"]
