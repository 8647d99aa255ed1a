"""Attention-score soft-capping (Gemma 2) in the Triton paged decode and varlen prefill kernels,
under TRITON_INTERPRET=1 against paged_attention_ref with softcap (itself checked against
transformers through the Gemma 2 parity of test_models_families.py): fresh random batches (the
shapes of test_kernels_attention.py), with and without sliding windows, float and quantized
caches, caps small enough to bite (scores of unit-variance q, k are O(1))."""
from __future__ import annotations

import kernel_env  # noqa: F401  (must precede the kernel imports: sets TRITON_INTERPRET=1)
import pytest
import torch
from kernel_env import assert_close, new_rng

from tritium.kernels.paged_attention import paged_attention_ref
from tritium.kernels.paged_decode import paged_decode
from tritium.kernels.prefill_attention import paged_attention
from test_kernels_attention import _prefill_lens, make_batch

NUM_SOFTCAP_CASES = 8


@pytest.mark.parametrize("case", range(NUM_SOFTCAP_CASES))
def test_paged_decode_softcap(case):
    rng, seed = new_rng()
    q, kc, vc, meta, ks, vs, dtype, desc = make_batch(rng, case, lambda s: 1, max_ctx=120)
    window = rng.choice([None, rng.randint(1, 40)]) if case % 2 else None
    cap = rng.uniform(0.5, 3.0)
    scale = q.shape[-1] ** -0.5
    got = paged_decode(q, kc, vc, meta.block_tables, meta.seq_lens, scale, window, ks, vs,
                       max_seq_len=meta.max_seq_len, partition_size=(None, 16, 32, 64)[case % 4], softcap=cap)
    ref = paged_attention_ref(q, kc, vc, meta, scale, window, ks, vs, softcap=cap)
    uncapped = paged_attention_ref(q, kc, vc, meta, scale, window, ks, vs)
    assert (ref.float() - uncapped.float()).abs().max() > 1e-2  # the cap changes the answer
    assert_close(got, ref, dtype, f"seed={seed} {desc} window={window} softcap={cap}")


@pytest.mark.parametrize("case", range(NUM_SOFTCAP_CASES))
def test_mixed_batch_softcap(case):
    rng, seed = new_rng()
    q, kc, vc, meta, ks, vs, dtype, desc = make_batch(rng, case, _prefill_lens(rng), max_ctx=70)
    window = rng.choice([None, rng.randint(1, 30)]) if case % 2 else None
    cap = rng.uniform(0.5, 3.0)
    scale = q.shape[-1] ** -0.5
    got = paged_attention(q, kc, vc, meta, scale, window, ks, vs, softcap=cap)
    ref = paged_attention_ref(q, kc, vc, meta, scale, window, ks, vs, softcap=cap)
    assert_close(got, ref, dtype, f"seed={seed} {desc} window={window} softcap={cap}")


def test_softcap_must_be_positive():
    q = torch.zeros(1, 2, 64)
    kc = torch.zeros(2, 16, 2, 64)
    bt, sl = torch.zeros(1, 2, dtype=torch.int32), torch.tensor([5], dtype=torch.int32)
    with pytest.raises(ValueError, match="softcap"):
        paged_decode(q, kc, kc.clone(), bt, sl, 0.125, softcap=0.0)


@pytest.mark.parametrize("hq,hkv,d,bs,window", [(8, 2, 64, 16, None), (4, 1, 32, 4, 7)])
def test_native_cpu_decode_softcap_matches_float64(hq, hkv, d, bs, window):
    """The native AVX512-BF16 decode kernel (kernels/cpu_decode_attention.c) with a soft-cap, on
    decode rows of a bf16 cache, against cap * tanh(s / cap) attention written out in float64."""
    from tritium.kernels import cpu_native
    from tritium.kernels.attention_metadata import AttentionMetadata
    from tritium.kernels.paged_attention import paged_attention_cpu
    if not {"avx512f", "avx512bw", "avx512_bf16"} <= cpu_native._cpu_flags():
        pytest.skip("CPU without AVX512-BF16: soft-capped decode rows use paged_attention_ref here")
    assert cpu_native.available(), "the CPU has AVX512-BF16 but the native kernels did not build"
    rng, seed = new_rng()
    seq_lens = [rng.randint(1, 60) for _ in range(6)]
    need = [-(-s // bs) for s in seq_lens]
    perm = torch.randperm(sum(need) + 2).tolist()
    tables, i = [], 0
    for n in need:
        tables.append(perm[i:i + n])
        i += n
    kc = torch.randn(len(perm), bs, hkv, d).to(torch.bfloat16)
    vc = torch.randn(len(perm), bs, hkv, d).to(torch.bfloat16)
    q = torch.randn(len(seq_lens), hq, d).to(torch.bfloat16)
    meta = AttentionMetadata.build([1] * len(seq_lens), seq_lens, tables, bs)
    cap, scale = rng.uniform(0.5, 3.0), d ** -0.5
    out = paged_attention_cpu(q, kc, vc, meta, scale, window, softcap=cap)
    for b, (slen, table) in enumerate(zip(seq_lens, tables)):
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(slen)])
        k = kc.view(-1, hkv, d)[slots].double().repeat_interleave(hq // hkv, dim=1)
        v = vc.view(-1, hkv, d)[slots].double().repeat_interleave(hq // hkv, dim=1)
        s = torch.einsum("hd,khd->hk", q[b].double(), k) * scale
        s = cap * torch.tanh(s / cap)
        if window is not None:
            s[:, : max(0, slen - window)] = float("-inf")
        want = torch.einsum("hk,khd->hd", s.softmax(-1), v)
        torch.testing.assert_close(out[b].double(), want, atol=2e-2, rtol=2e-2, msg=lambda m: f"seed={seed}: {m}")
