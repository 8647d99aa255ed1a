"""Triton element-wise kernels (RMSNorm, RoPE, SiLU-mul, KV write) vs their torch references.

Runs under Triton's interpreter on CPU; every case draws a fresh random shape and data.
"""
from __future__ import annotations

import kernel_env  # noqa: F401  (must precede the kernel imports: sets TRITON_INTERPRET=1)
import pytest
import torch
from kernel_env import FP8_STEP, NUM_CASES, assert_close, nan_like, new_rng

from tritium.kernels.elementwise_triton import rms_norm, rotary, silu_mul
from tritium.kernels.kv_write_ref import dequantize_kv_ref, kv_write_ref
from tritium.kernels.kv_write_triton import kv_write
from tritium.kernels.rms_norm_ref import rms_norm_ref
from tritium.kernels.rotary_ref import rope_cos_sin_cache, rope_inv_freq, rotary_ref
from tritium.kernels.silu_mul_ref import silu_mul_ref

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
HEAD_DIMS = (64, 80, 128)


@pytest.mark.parametrize("case", range(NUM_CASES))
def test_rms_norm_kernel(case):
    rng, seed = new_rng()
    dtype = DTYPES[case % 3]
    t, h = rng.choice([1, 2, 5, 13]), rng.choice([64, 80, 96, 200, 576])
    x = torch.randn(t, h).to(dtype)
    w = (1 + 0.1 * torch.randn(h)).to(dtype)
    res = torch.randn(t, h).to(dtype) if case % 2 else None
    eps = rng.choice([1e-5, 1e-6])
    out, res_out = nan_like(x), nan_like(x)
    got, got_res = rms_norm(x, w, eps, res, out=out, residual_out=res_out if res is not None else None)
    ref, ref_res = rms_norm_ref(x, w, eps, res)
    assert got.data_ptr() == out.data_ptr()
    msg = f"seed={seed} t={t} h={h} residual={res is not None}"
    assert_close(got, ref, dtype, msg)
    assert_close(got_res, ref_res, dtype, msg)


@pytest.mark.parametrize("case", range(NUM_CASES))
def test_rotary_kernel(case):
    rng, seed = new_rng()
    dtype = DTYPES[case % 3]
    d = HEAD_DIMS[case % 3]
    hkv = rng.choice([1, 2, 3])
    hq = hkv * (1, 3, 8)[(case // 3) % 3]
    t = rng.choice([1, 3, 7, 16])
    scaling = ("default", "llama3", "linear")[case % 3]
    inv = rope_inv_freq(d, rng.choice([10000.0, 500000.0]), scaling, factor=8.0 if scaling != "default" else 1.0,
                        original_max_position_embeddings=64)
    cache = rope_cos_sin_cache(inv, 300)
    # q, k as strided views of one fused qkv row, like the model's projections
    qkv = torch.randn(t, (hq + 2 * hkv) * d).to(dtype)
    q = qkv[:, :hq * d].view(t, hq, d)
    k = qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
    pos = torch.randint(0, 300, (t,))
    q_out, k_out = nan_like(q.contiguous()), nan_like(k.contiguous())
    gq, gk = rotary(q, k, pos, cache, q_out=q_out, k_out=k_out)
    rq, rk = rotary_ref(q, k, pos, cache)
    msg = f"seed={seed} t={t} hq={hq} hkv={hkv} d={d} {scaling}"
    assert_close(gq, rq, dtype, msg)
    assert_close(gk, rk, dtype, msg)


@pytest.mark.parametrize("case", range(NUM_CASES))
def test_silu_mul_kernel(case):
    rng, seed = new_rng()
    dtype = DTYPES[case % 3]
    lead = rng.choice([(1,), (5,), (2, 3), (17,)])
    n = rng.choice([8, 96, 100, 1536, 1100])
    x = (2 * torch.randn(*lead, 2 * n)).to(dtype)
    out = torch.full((*lead, n), float("nan"), dtype=dtype)
    got = silu_mul(x, out=out)
    assert_close(got, silu_mul_ref(x), dtype, f"seed={seed} lead={lead} n={n}")


def _assert_cache_equal(got, ref, msg):
    if got.dtype in (torch.int8,):
        diff = (got.int() - ref.int()).abs()
        # exact rounding is implemented; tolerate one step for non-IEEE division on GPUs
        assert diff.max() <= 1 and (diff == 0).float().mean() > 0.99, msg
    elif got.dtype == torch.float8_e4m3fn:
        g, r = got.float(), ref.float()
        assert ((g - r).abs() <= FP8_STEP * r.abs() + 2 ** -9).all(), msg
        assert (g == r).float().mean() > 0.99, msg
    else:
        assert torch.equal(got.isnan(), ref.isnan()), f"written slots differ {msg}"
        assert torch.equal(got.nan_to_num(), ref.nan_to_num()), msg


@pytest.mark.parametrize("case", range(NUM_CASES))
def test_kv_write_kernel(case):
    rng, seed = new_rng()
    dtype = DTYPES[case % 3]
    cache_dtype = (None, torch.int8, torch.float8_e4m3fn)[(case // 3) % 3]
    d = HEAD_DIMS[case % 3]
    block_size = (16, 32)[case % 2]
    hkv = rng.choice([1, 2, 4])
    num_blocks = rng.choice([2, 5])
    t = rng.randint(1, min(40, num_blocks * block_size))
    k, v = torch.randn(t, hkv, d).to(dtype), torch.randn(t, hkv, d).to(dtype)
    slots = torch.randperm(num_blocks * block_size)[:t]
    if case % 4 == 0:
        slots[0] = -1  # a padding token: must be skipped
    ks = vs = None
    shape = (num_blocks, block_size, hkv, d)
    if cache_dtype is None:
        cache_k, cache_v = torch.full(shape, float("nan"), dtype=dtype), torch.full(shape, float("nan"), dtype=dtype)
    else:
        qmax = 127.0 if cache_dtype == torch.int8 else 448.0
        # per-head scales from the data, like calibration; case 5 saturates on purpose
        ks = k.float().abs().amax(dim=(0, 2)) / qmax * (0.5 if case == 5 else 1.0 + rng.random())
        vs = v.float().abs().amax(dim=(0, 2)) / qmax * (1.0 + rng.random())
        cache_k = torch.randint(-100, 100, shape).to(cache_dtype)
        cache_v = torch.randint(-100, 100, shape).to(cache_dtype)
    rk, rv = cache_k.clone(), cache_v.clone()
    kv_write(k, v, cache_k, cache_v, slots, ks, vs)
    valid = slots >= 0
    kv_write_ref(k[valid], v[valid], rk, rv, slots[valid], ks, vs)
    msg = f"seed={seed} t={t} hkv={hkv} d={d} bs={block_size} cache={cache_dtype} {dtype}"
    _assert_cache_equal(cache_k, rk, msg)
    _assert_cache_equal(cache_v, rv, msg)
    if cache_dtype is not None and case != 5:  # the stored values dequantize back near the inputs
        back = dequantize_kv_ref(cache_v.view(-1, hkv, d)[slots[valid]], vs, torch.float32)
        want = v[valid].float()
        # int8: half a step of the scale; e4m3: half a step, 2^-4 relative (or the subnormal step)
        bound = 0.5 * vs[None, :, None] + 1e-6 if cache_dtype == torch.int8 else \
            want.abs() / 16 + vs[None, :, None] * 2 ** -9
        assert ((back - want).abs() <= bound * 1.01).all(), msg


def test_rms_norm_kernel_rejects_bad_input():
    x = torch.randn(3, 64)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.randn(32), 1e-6)
    with pytest.raises(ValueError, match="x"):
        rms_norm(x.int(), torch.randn(64), 1e-6)
    with pytest.raises(ValueError, match="k_scale"):
        kv_write(torch.randn(1, 1, 64), torch.randn(1, 1, 64), torch.zeros(1, 16, 1, 64, dtype=torch.int8),
                 torch.zeros(1, 16, 1, 64, dtype=torch.int8), torch.tensor([0]))


@pytest.mark.parametrize("case", range(NUM_CASES))
def test_cpu_rms_norm_and_rotary_match_references(case):
    """The CPU fast paths (fused rms_norm, rotary from per-step tables) vs the references."""
    from tritium.kernels.rms_norm_ref import rms_norm_cpu
    from tritium.kernels.rotary_ref import rotary_cpu, rotary_tables
    rng, seed = new_rng()
    dtype = DTYPES[case % 3]
    t, h = rng.choice([1, 2, 5, 13]), rng.choice([64, 96, 576])
    x, w = torch.randn(t, h).to(dtype), (1 + 0.1 * torch.randn(h)).to(dtype)
    res = torch.randn(t, h).to(dtype) if case % 2 else None
    got, got_res = rms_norm_cpu(x, w, 1e-5, res)
    ref, ref_res = rms_norm_ref(x, w, 1e-5, res)
    assert_close(got, ref, dtype, f"rms seed={seed}")
    assert torch.equal(got_res, ref_res)
    d, hkv = HEAD_DIMS[case % 3], rng.choice([1, 3])
    hq = hkv * rng.choice([1, 3])
    cache = rope_cos_sin_cache(rope_inv_freq(d, 10000.0), 300)
    qkv = torch.randn(t, (hq + 2 * hkv) * d).to(dtype)
    q, k = qkv[:, :hq * d].view(t, hq, d), qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
    pos = torch.randint(0, 300, (t,))
    gq, gk = rotary_cpu(q, k, rotary_tables(pos, cache, dtype))
    rq, rk = rotary_ref(q, k, pos, cache)
    assert_close(gq, rq, dtype, f"rotary q seed={seed}")
    assert_close(gk, rk, dtype, f"rotary k seed={seed}")
