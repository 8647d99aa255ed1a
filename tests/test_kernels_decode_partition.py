"""Paged decode with a fixed partition: the compile-time constants of both kernels do not depend
on the context length (one compiled kernel serves 16..8192 keys), and more partials than one
reduce chunk still merge to the torch reference (under the interpreter)."""
from __future__ import annotations

import kernel_env  # noqa: F401  (must precede the kernel imports: sets TRITON_INTERPRET=1)
import pytest
import torch
from kernel_env import assert_close, new_rng

from tritium.kernels import attention_decode_triton as pd
from tritium.kernels.attention_metadata import AttentionMetadata
from tritium.kernels.attention_ref import paged_attention_ref


class _Recorder:
    """Stands in for a @triton.jit kernel: records the constexpr (upper-case) and launch options."""

    def __init__(self, fn, seen: list):
        self.fn, self.seen = fn, seen

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            const = {k: v for k, v in kwargs.items() if k.isupper() or k.startswith("num_")}
            self.seen.append((self.fn.__name__, tuple(sorted(const.items()))))
        return launch


def test_decode_constexprs_do_not_depend_on_context(monkeypatch):
    seen: list = []
    monkeypatch.setattr(pd, "_paged_decode_kernel", _Recorder(pd._paged_decode_kernel.fn, seen))
    monkeypatch.setattr(pd, "_paged_decode_reduce_kernel", _Recorder(pd._paged_decode_reduce_kernel.fn, seen))
    hkv, d, bs = 2, 64, 16
    kc = torch.zeros(8192 // bs + 1, bs, hkv, d, dtype=torch.bfloat16)
    q = torch.zeros(2, 4, d, dtype=torch.bfloat16)
    ctxs = [16, 17, 255, 256, 257, 1000, 2048, 4097, 8192]
    for ctx in ctxs:
        bt = torch.arange(2 * (ctx // bs + 1), dtype=torch.int32).view(2, -1) % kc.shape[0]
        sl = torch.tensor([ctx, max(1, ctx // 3)], dtype=torch.int32)
        pd.paged_decode(q, kc, kc, bt, sl, 0.1, max_seq_len=ctx)
    assert len(seen) == 2 * len(ctxs)
    by_kernel = {}
    for name, const in seen:
        by_kernel.setdefault(name, set()).add(const)
    assert set(by_kernel) == {"_paged_decode_kernel", "_paged_decode_reduce_kernel"}
    for name, variants in by_kernel.items():
        assert len(variants) == 1, f"{name}: constexprs vary with the context: {variants}"
    assert dict(next(iter(by_kernel["_paged_decode_kernel"])))["PARTITION"] == pd.DECODE_PARTITION


@pytest.mark.parametrize("case", range(4))
def test_decode_merges_more_partials_than_one_chunk(case):
    """partition 16 over up to 700 keys: up to 44 partials, merged REDUCE_CHUNK at a time."""
    rng, seed = new_rng()
    dtype = (torch.float32, torch.bfloat16)[case % 2]
    hkv, gqa, d, bs = 2, 2, 32, 16
    seq_lens = [rng.randint(pd.REDUCE_CHUNK * 16 + 1, 700) for _ in range(2)] + [rng.randint(1, 40)]
    nblk = [-(-s // bs) for s in seq_lens]
    perm = torch.randperm(sum(nblk)).tolist()
    tables, o = [], 0
    for n in nblk:
        tables.append(perm[o:o + n])
        o += n
    meta = AttentionMetadata.build([1] * len(seq_lens), seq_lens, tables, bs, device=torch.device("cpu"))
    kc = torch.randn(sum(nblk), bs, hkv, d).to(dtype)
    vc = torch.randn(sum(nblk), bs, hkv, d).to(dtype)
    q = torch.randn(len(seq_lens), hkv * gqa, d).to(dtype)
    sinks = torch.randn(hkv * gqa) if case >= 2 else None
    got = pd.paged_decode(q, kc, vc, meta.block_tables, meta.seq_lens, d ** -0.5, partition_size=16,
                          max_seq_len=meta.max_seq_len, sinks=sinks)
    ref = paged_attention_ref(q, kc, vc, meta, d ** -0.5, sinks=sinks) if sinks is not None else \
        paged_attention_ref(q, kc, vc, meta, d ** -0.5)
    assert_close(got, ref, dtype, f"seed={seed} seq_lens={seq_lens} sinks={sinks is not None}")
