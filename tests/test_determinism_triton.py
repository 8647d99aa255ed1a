"""Batch invariance of the Triton attention kernels, under Triton's interpreter (TRITON_INTERPRET=1,
CPU tensors; the same kernels a GPU compiles): a decode row's bits do not depend on the other rows
of the step (fixed split size, merge always run), and with AttentionMetadata.deterministic a query
row gets the same bits in a whole prefill, a chunk after cached context and a decode. Numerics
against attention_ref.paged_attention_ref.
"""
from __future__ import annotations

import kernel_env  # noqa: F401  (must precede the kernel imports: sets TRITON_INTERPRET=1)
import pytest
import torch
from kernel_env import assert_close, new_rng

from tritium.kernels.attention_metadata import AttentionMetadata
from tritium.kernels.attention_ref import paged_attention_ref
from tritium.kernels.attention_decode_triton import DECODE_PARTITION
from tritium.kernels.attention_prefill_triton import paged_attention

from test_determinism_kernels import _cache


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_row_alone_equals_row_beside_a_long_context(dtype):
    _, seed = new_rng()
    bs, hq, hkv, d = 16, 6, 2, 64
    long = 2 * DECODE_PARTITION + 70  # another row of the step needs three partitions
    kc, vc, tables = _cache([300, long], bs, hkv, d, dtype)
    q = torch.randn(2, hq, d).to(dtype)
    alone = paged_attention(q[:1], kc, vc, AttentionMetadata.build([1], [300], tables[:1], bs), d ** -0.5)
    both = paged_attention(q, kc, vc, AttentionMetadata.build([1, 1], [300, long], tables, bs), d ** -0.5)
    assert torch.equal(both[:1], alone), f"seed={seed}"
    ref = paged_attention_ref(q, kc, vc, AttentionMetadata.build([1, 1], [300, long], tables, bs), d ** -0.5)
    assert_close(both, ref, dtype, f"seed={seed}")


def test_deterministic_rows_same_in_prefill_chunk_and_decode():
    _, seed = new_rng()
    bs, hq, hkv, d, total = 16, 4, 2, 32, 29
    kc, vc, tables = _cache([total], bs, hkv, d)
    q = torch.randn(total, hq, d).bfloat16()

    def run(n, s, rows):
        meta = AttentionMetadata.build([n], [s], tables, bs)
        meta.deterministic = True
        return paged_attention(rows.contiguous(), kc, vc, meta, d ** -0.5)

    whole = run(total, total, q)
    ref = paged_attention_ref(q, kc, vc, AttentionMetadata.build([total], [total], tables, bs), d ** -0.5)
    assert_close(whole, ref, torch.bfloat16, f"seed={seed}")
    assert torch.equal(run(total - 11, total, q[11:]), whole[11:]), f"seed={seed}"
    assert torch.equal(run(1, 20, q[19:20]), whole[19:20]), f"seed={seed}"
