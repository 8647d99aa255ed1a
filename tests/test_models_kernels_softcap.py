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
