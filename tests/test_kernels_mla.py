"""The multi-head latent attention ops (kernels/mla_triton.py, ops.mla_attention's CPU path)
against their torch reference, kernels/mla_ref.py, under Triton's interpreter: random head
counts (across the kernel's 16-head blocks), latent and rope widths, page sizes, context lengths,
decode and prompt rows, and dtypes. The Triton kernel sees the cache's unused blocks filled with NaN (a read outside a
sequence's table shows); the CPU path, whose padded gathers rely on the runner's zero-filled
pool, sees them zeroed."""
from __future__ import annotations

import kernel_env  # noqa: F401  (must precede the kernel imports: sets TRITON_INTERPRET=1)

import pytest
import torch

from kernel_env import NUM_CASES, assert_close, new_rng
from tritium.kernels import ops
from tritium.kernels.attention_metadata import AttentionMetadata
from tritium.kernels.mla_ref import mla_attention_ref
from tritium.kernels.mla_triton import mla_attention


def _case(rng, query_lens_max: int):
    heads = rng.choice([1, 3, 16, 20])
    rank, rope = rng.choice([(16, 8), (40, 8), (64, 16), (32, 64)])
    page = rng.choice([4, 16])
    dtype = rng.choice([torch.float32, torch.bfloat16])
    b = rng.randint(1, 4)
    seq_lens = [rng.randint(1, 70) for _ in range(b)]
    query_lens = [min(s, rng.randint(1, query_lens_max)) for s in seq_lens]
    need = [-(-s // page) for s in seq_lens]
    num_blocks = sum(need) + 3
    ids = torch.randperm(num_blocks).tolist()  # scattered, not in order
    tables, at = [], 0
    for n in need:
        tables.append(ids[at:at + n])
        at += n
    cache = torch.full((num_blocks, page, 1, rank + rope), float("nan"), dtype=dtype)
    for t in tables:
        cache[t] = torch.randn(len(t), page, 1, rank + rope).to(dtype)
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, page, "cpu")
    q = torch.randn(sum(query_lens), heads, rank + rope).to(dtype)
    # unwritten slots past a sequence's end stay NaN in its last block: zero them as the runner's
    # zero-filled pool does (the kernels mask them; a NaN times a zero weight would still be NaN)
    for t, s in zip(tables, seq_lens):
        flat = cache[t].reshape(-1, rank + rope)
        flat[s:] = 0
        cache[t] = flat.view(len(t), page, 1, rank + rope)
    scale = (rank + rope) ** -0.5 * rng.uniform(0.5, 2.0)
    return q, cache, meta, scale, rank, dtype, (heads, rank, rope, page, seq_lens, query_lens)


@pytest.mark.parametrize("case", range(NUM_CASES))
def test_mla_triton_matches_reference(case):
    """Decode rows only in even cases, prompt rows (query lengths up to 9) mixed in odd ones."""
    rng, seed = new_rng()
    q, cache, meta, scale, rank, dtype, desc = _case(rng, 1 if case % 2 == 0 else 9)
    out = mla_attention(q, cache, meta, scale, rank)
    assert out.shape == (q.shape[0], q.shape[1], rank)
    assert_close(out, mla_attention_ref(q, cache, meta, scale, rank), dtype, f"seed {seed} {desc}")


@pytest.mark.parametrize("case", range(NUM_CASES))
def test_mla_attention_cpu_matches_reference(case, monkeypatch):
    """Prompt and decode rows mixed (query lengths up to 9), the CPU path."""
    monkeypatch.setenv("TRITIUM_KERNELS", "reference")
    rng, seed = new_rng()
    q, cache, meta, scale, rank, dtype, desc = _case(rng, 9)
    cache = cache.nan_to_num(0.0)  # the runner's pool is zero-filled
    meta.cpu_plan = ops.attention_plan(meta)
    out = ops.mla_attention(q, cache, meta, scale, rank)
    assert_close(out, mla_attention_ref(q, cache, meta, scale, rank), dtype, f"seed {seed} {desc}")


def test_mla_triton_refuses_mismatched_rows():
    q = torch.randn(3, 2, 24)
    cache = torch.zeros(2, 4, 1, 24)
    meta = AttentionMetadata.build([2], [3], [[0]], 4, "cpu")
    with pytest.raises(ValueError, match="q has 3 rows, the metadata 2"):
        mla_attention(q, cache, meta, 1.0, 16)


def _steps(model, ids, n):
    """Greedy prefill + n - 1 decode steps over a fresh cache: (tokens, logits (n, vocab))."""
    from simple_generate import alloc_kv_caches
    bs = model.cfg.limits.block_size
    kv = alloc_kv_caches(model, 4)
    toks, new, logs = list(ids), list(ids), []
    for _ in range(n):
        meta = AttentionMetadata.build([len(new)], [len(toks)], [list(range(4))], bs, "cpu")
        with torch.inference_mode():
            h = model(torch.tensor(new), torch.arange(len(toks) - len(new), len(toks)), kv, meta)
            logs.append(model.compute_logits(h[-1:])[0])
        toks.append(int(logs[-1].argmax()))
        new = toks[-1:]
    return toks[len(ids):], torch.stack(logs)


def test_deepseek_v3_on_the_triton_side_equals_the_cpu_path(tiny_checkpoint, tiny_engine, monkeypatch):
    """A tiny DeepSeek-V3 (tests/deepseek_models.py) with every op on the Triton side (interpreter),
    attention through mla_triton (prefill and decode): the CPU path's greedy tokens and logits within 1e-5."""
    from deepseek_models import with_bias
    from tritium.backend.loader import load_engine
    from tritium.kernels import mla_triton
    with_bias(tiny_checkpoint("deepseek_v3"))
    _, model, _ = load_engine(tiny_engine("deepseek_v3"), "cpu")
    ids = [5, 17, 923, 44, 300, 2, 81]
    monkeypatch.setenv("TRITIUM_KERNELS", "reference")
    ref, ref_logits = _steps(model, ids, 4)
    calls = []
    real = mla_triton.mla_attention
    monkeypatch.setattr(mla_triton, "mla_attention", lambda *a: calls.append(a[0].shape) or real(*a))
    monkeypatch.setenv("TRITIUM_KERNELS", "triton")
    got, logits = _steps(model, ids, 4)
    assert got == ref and ((logits - ref_logits).norm() / ref_logits.norm()).item() < 1e-5
    assert len(calls) == 4 * model.cfg.model.num_layers  # the prefill and three decode steps, every layer
    assert calls[0][0] == len(ids) and calls[-1][0] == 1
