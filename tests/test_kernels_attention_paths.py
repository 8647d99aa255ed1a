"""The native paged attention kernel (kernels/cpu_decode_attention.c, with its AVX2 blocked row in
cpu_attention_avx2.h) on every CPU path, forced (`cpu_path`; ids name the path), against the
plain-torch reference (kernels/attention_ref.py) in float32: a mixed step of prompt chunks after
cached context and decode rows, contexts that end inside a 64-key chunk and past several, head
dims that take the blocked row (D % 8 == 0, D % 16 == 0 and == 8) and the plain one (D % 8 != 0),
GQA, a sliding window and a score soft-cap."""
from __future__ import annotations

import pytest
import torch

from seeds import fixed_seed
from tritium.kernels import cpu_native
from tritium.kernels.attention_cpu import paged_attention_cpu
from tritium.kernels.attention_metadata import AttentionMetadata
from tritium.kernels.attention_ref import paged_attention_ref

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("hq,hkv,d,window,softcap", [
    (9, 3, 64, None, None),    # SmolLM2: blocked row
    (4, 2, 40, None, 30.0),    # D % 16 == 8: the even accumulator takes the last block
    (8, 1, 128, 70, None),     # sliding window over a long context
    (6, 3, 18, None, None),    # D % 8 != 0: the plain row
])
def test_native_attention_matches_reference_on_every_path(cpu_path, hq, hkv, d, window, softcap):
    seed = fixed_seed()
    torch.manual_seed(seed)
    assert cpu_native.isa() == cpu_path, f"forced {cpu_path}, kernels report {cpu_native.isa()}"
    bs = 16
    query_lens, seq_lens = [150, 33, 1, 1, 1], [150, 200, 64, 65, 301]  # prompt, chunk after 167 cached, decodes
    need = [-(-s // bs) for s in seq_lens]
    ids = torch.randperm(sum(need) + 3).tolist()
    tables = [[ids.pop() for _ in range(n)] for n in need]
    kc = torch.randn(sum(need) + 3, bs, hkv, d).bfloat16()
    vc = torch.randn_like(kc)
    q = (torch.randn(sum(query_lens), hq, d) * 2).bfloat16()
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, bs)
    got = paged_attention_cpu(q, kc, vc, meta, d ** -0.5, window, softcap=softcap)
    ref = paged_attention_ref(q.float(), kc.float(), vc.float(), meta, d ** -0.5, window, softcap=softcap)
    torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2,
                               msg=lambda s: f"path={cpu_path} seed={seed}: {s}")
    # a row's bits do not depend on the step: each decode row alone gives the same output
    for b in (2, 3, 4):
        alone = AttentionMetadata.build([1], [seq_lens[b]], [tables[b]], bs)
        row = sum(query_lens[:b])
        one = paged_attention_cpu(q[row:row + 1].contiguous(), kc, vc, alone, d ** -0.5, window, softcap=softcap)
        assert torch.equal(one, got[row:row + 1]), f"path={cpu_path} seed={seed} row={row}"


@pytest.mark.parametrize("hq,hkv,d,softcap", [(9, 3, 64, None), (4, 2, 40, 30.0), (6, 3, 18, None), (8, 1, 128, None)])
def test_attention_head_ranges_same_bits_as_whole_rows(cpu_path, hq, hkv, d, softcap):
    """tritium_paged_decode_heads_bf16 (the native step's attention items: query heads [r0, r1) of
    one row, any range, inside a KV head's group or across groups) writes exactly the bits the whole
    kernel gives those heads, and nothing else; the whole kernel is checked against the torch
    reference above."""
    seed = fixed_seed()
    torch.manual_seed(seed)
    assert cpu_native.isa() == cpu_path, f"forced {cpu_path}, kernels report {cpu_native.isa()}"
    bs, seq_lens = 16, [1, 64, 65, 301]
    need = [-(-s // bs) for s in seq_lens]
    ids = torch.randperm(sum(need) + 3).tolist()
    tables = torch.tensor([[ids.pop() for _ in range(n)] + [0] * (max(need) - n) for n in need], dtype=torch.int32)
    kc = torch.randn(sum(need) + 3, bs, hkv, d).bfloat16()
    vc = torch.randn_like(kc)
    q = (torch.randn(len(seq_lens), hq, d) * 2).bfloat16()
    # rows: token row, block-table row, first key, context length (the last row: a window from key 40)
    rows = torch.tensor([[i, i, 40 if i == 3 else 0, n] for i, n in enumerate(seq_lens)], dtype=torch.int64)
    whole = torch.zeros_like(q)
    cpu_native.paged_decode_bf16(q, kc, vc, tables, rows, d ** -0.5, whole, softcap=softcap)
    lib = cpu_native._lib()
    cuts = sorted({0, 1, hq // 2, hq - 1, hq})
    for i, (tok, sq, lo, ln) in enumerate(rows.tolist()):
        for r0, r1 in [(a, b) for a in cuts for b in cuts if a < b]:
            part = torch.zeros_like(q)
            lib.tritium_paged_decode_heads_bf16(q.data_ptr(), kc.data_ptr(), vc.data_ptr(), tables.data_ptr(),
                                                tables.shape[1], tok, sq, lo, ln, hq, hkv, d, bs, d ** -0.5,
                                                float(softcap or 0.0), r0, r1, part.data_ptr())
            assert torch.equal(part[i, r0:r1], whole[i, r0:r1]), f"path={cpu_path} seed={seed} row={i} heads={r0}:{r1}"
            rest = part.clone()
            rest[i, r0:r1] = 0
            assert not rest.any(), f"path={cpu_path} row={i} heads={r0}:{r1}: wrote outside its heads"
