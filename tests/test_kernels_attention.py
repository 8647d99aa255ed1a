"""Triton paged decode and varlen prefill attention vs paged_attention_ref (interpreter, CPU).

Each case draws a fresh random batch: head_dim 64/80/128, block sizes 16/32, GQA ratios 1/3/8,
contexts that are not block multiples, one or many sequences, float/INT8/FP8 caches, sliding
windows, shuffled block tables. Unused cache slots hold NaN so reads past a context fail.
"""
from __future__ import annotations

import kernel_env  # noqa: F401  (must precede the kernel imports: sets TRITON_INTERPRET=1)
import pytest
import torch
from kernel_env import NUM_CASES, assert_close, new_rng

from tritium.kernels.attention_metadata import AttentionMetadata
from tritium.kernels.kv_write_ref import quantize_kv_ref
from tritium.kernels.attention_ref import paged_attention_ref
from tritium.kernels.attention_decode_triton import paged_decode
from tritium.kernels.attention_prefill_triton import paged_attention, prefill_attention

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
HEAD_DIMS = (64, 80, 128)
GQA = (1, 3, 8)
KV_DTYPES = (None, torch.int8, torch.float8_e4m3fn)


def make_batch(rng, case, query_lens_fn, max_ctx):
    """Random paged batch. Returns (q, k_cache, v_cache, meta, k_scale, v_scale, dtype, desc)."""
    dtype = DTYPES[case % 3]
    d = HEAD_DIMS[(case // 3) % 3]
    block_size = (16, 32)[case % 2]
    gqa = GQA[(case // 2) % 3]
    hkv = rng.choice([1, 2])
    kv_dtype = KV_DTYPES[(case // 5) % 3]
    num_seqs = 1 if case % 4 == 0 else rng.randint(2, 5)
    seq_lens = [rng.randint(1, max_ctx) for _ in range(num_seqs)]
    if all(s % block_size == 0 for s in seq_lens):
        seq_lens[0] += 1  # at least one context that ends mid-block
    query_lens = [query_lens_fn(s) for s in seq_lens]
    need = [(s + block_size - 1) // block_size for s in seq_lens]
    num_blocks = sum(need) + rng.randint(1, 3)
    perm = torch.randperm(num_blocks).tolist()
    tables, i = [], 0
    for n in need:
        tables.append(perm[i:i + n])
        i += n
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size)
    shape = (num_blocks, block_size, hkv, d)
    k_cache, v_cache = torch.randn(shape), torch.randn(shape)
    k_scale = v_scale = None
    if kv_dtype is None:
        # slots outside every context hold NaN: the kernels must never read them
        used = torch.zeros(num_blocks * block_size, dtype=torch.bool)
        for s, t in zip(seq_lens, tables):
            for p in range(s):
                used[t[p // block_size] * block_size + p % block_size] = True
        k_cache.view(-1, hkv, d)[~used] = float("nan")
        v_cache.view(-1, hkv, d)[~used] = float("nan")
        k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    else:
        qmax = 127.0 if kv_dtype == torch.int8 else 448.0
        k_scale = k_cache.abs().amax(dim=(0, 1, 3)) / qmax
        v_scale = v_cache.abs().amax(dim=(0, 1, 3)) / qmax
        k_cache = quantize_kv_ref(k_cache.view(-1, hkv, d), k_scale, kv_dtype).view(shape)
        v_cache = quantize_kv_ref(v_cache.view(-1, hkv, d), v_scale, kv_dtype).view(shape)
    q = torch.randn(sum(query_lens), hkv * gqa, d).to(dtype)
    desc = (f"dtype={dtype} d={d} bs={block_size} hkv={hkv} gqa={gqa} kv={kv_dtype} "
            f"seq_lens={seq_lens} query_lens={query_lens}")
    return q, k_cache, v_cache, meta, k_scale, v_scale, dtype, desc


@pytest.mark.parametrize("case", range(NUM_CASES))
def test_paged_decode_kernel(case):
    rng, seed = new_rng()
    q, kc, vc, meta, ks, vs, dtype, desc = make_batch(rng, case, lambda s: 1, max_ctx=150)
    window = rng.choice([None, rng.randint(1, 40)]) if case % 3 else None
    partition = (None, 16, 32, 64)[case % 4]  # 16..64 force the split-K + reduce path
    scale = q.shape[-1] ** -0.5
    out = torch.full_like(q, float("nan"))
    got = paged_decode(q, kc, vc, meta.block_tables, meta.seq_lens, scale, window, ks, vs,
                       max_seq_len=meta.max_seq_len, partition_size=partition, out=out)
    ref = paged_attention_ref(q, kc, vc, meta, scale, window, ks, vs)
    assert got.data_ptr() == out.data_ptr()
    assert_close(got, ref, dtype, f"seed={seed} {desc} window={window} partition={partition}")


def _prefill_lens(rng):
    def fn(s):
        r = rng.random()
        if r < 0.2:
            return 1  # a decode row inside a mixed batch
        if r < 0.6:
            return s  # whole prompt
        return rng.randint(1, s)  # a later chunk: earlier context comes from the cache
    return fn


@pytest.mark.parametrize("case", range(NUM_CASES))
def test_prefill_attention_kernel(case):
    rng, seed = new_rng()
    q, kc, vc, meta, ks, vs, dtype, desc = make_batch(rng, case, _prefill_lens(rng), max_ctx=70)
    window = rng.choice([None, rng.randint(1, 30)]) if case % 3 else None
    scale = q.shape[-1] ** -0.5
    out = torch.full_like(q, float("nan"))
    block_n = rng.choice([16, 32, 64])
    got = prefill_attention(q, kc, vc, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                            meta.max_query_len, scale, window, ks, vs, out=out, block_m=16, block_n=block_n)
    ref = paged_attention_ref(q, kc, vc, meta, scale, window, ks, vs)
    assert_close(got, ref, dtype, f"seed={seed} {desc} window={window} block_n={block_n}")


@pytest.mark.parametrize("case", range(NUM_CASES))
def test_mixed_batch_attention_kernel(case):
    """The op the model calls: decode rows to paged decode, the rest to varlen prefill."""
    rng, seed = new_rng()
    q, kc, vc, meta, ks, vs, dtype, desc = make_batch(rng, case, _prefill_lens(rng), max_ctx=100)
    window = rng.choice([None, rng.randint(1, 30)]) if case % 2 else None
    scale = q.shape[-1] ** -0.5
    got = paged_attention(q, kc, vc, meta, scale, window, ks, vs)
    ref = paged_attention_ref(q, kc, vc, meta, scale, window, ks, vs)
    assert_close(got, ref, dtype, f"seed={seed} {desc} window={window}")


def test_paged_decode_kernel_rejects_bad_input():
    kc = torch.zeros(2, 16, 2, 64)
    bt, sl = torch.zeros(1, 2, dtype=torch.int32), torch.tensor([5], dtype=torch.int32)
    with pytest.raises(ValueError, match="num_heads"):
        paged_decode(torch.randn(1, 3, 64), kc, kc, bt, sl, 0.1)
    with pytest.raises(ValueError, match="k_scale"):
        kq = kc.to(torch.int8)
        paged_decode(torch.randn(1, 4, 64), kq, kq, bt, sl, 0.1)
    with pytest.raises(ValueError, match="partition_size"):
        paged_decode(torch.randn(1, 4, 64), kc, kc, bt, sl, 0.1, partition_size=24)
