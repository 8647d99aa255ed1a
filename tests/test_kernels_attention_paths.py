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
