"""The kernels on the new families' paths, under TRITON_INTERPRET=1 (Triton) and natively (CPU).

Attention-score soft-capping (Gemma 2) in the Triton paged decode and varlen prefill kernels
against paged_attention_ref with softcap (itself checked against transformers through the Gemma 2
parity of test_models_families.py): fresh random batches (the shapes of test_kernels_attention.py),
with and without sliding windows, float and quantized caches, caps small enough to bite (scores of
unit-variance q, k are O(1)). The native CPU decode kernel with a soft-cap against float64. And
each family's layer shape (sandwich / post norms, q/k norms, partial rotary with LongRoPE, local
rope tables, NoPE layers, soft-caps) through every Triton kernel end to end, against the
reference path."""
from __future__ import annotations

import kernel_env  # noqa: F401  (must precede the kernel imports: sets TRITON_INTERPRET=1)
import pytest
import torch
from kernel_env import assert_close, new_rng

from tritium.kernels.attention_ref import paged_attention_ref
from tritium.kernels.attention_decode_triton import paged_decode
from tritium.kernels.attention_prefill_triton import paged_attention
from test_kernels_attention import _prefill_lens, make_batch

NUM_SOFTCAP_CASES = 6


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
def test_native_cpu_decode_softcap_matches_float64(hq, hkv, d, bs, window, cpu_path):
    """The native decode kernel of each CPU path (kernels/cpu_decode_attention.c) with a soft-cap,
    on decode rows of a bf16 cache, against cap * tanh(s / cap) attention written out in float64."""
    from tritium.kernels import cpu_native
    from tritium.kernels.attention_metadata import AttentionMetadata
    from tritium.kernels.attention_cpu import paged_attention_cpu
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
    assert cpu_native.decode_supported(q, kc, None) and cpu_native.isa() == cpu_path
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


# Family shapes through the Triton kernels end to end (interpreter): the reference path's greedy
# tokens and logits (test_kernels_e2e's loop: chunked prefill beside decodes, paged cache).
FAMILY_MODELS = {
    "gemma2": dict(norm_placement="sandwich", activation="gelu_tanh", attention_scale=24 ** -0.5,
                   attn_logit_softcap=1.5, final_logit_softcap=3.0, embedding_multiplier=8.0,
                   sliding_windows=(5, None)),
    "gemma3": dict(norm_placement="sandwich", activation="gelu_tanh", qk_norm="head", final_logit_softcap=4.0,
                   sliding_windows=(6, None), rope_local={"theta": 100.0}),
    "phi3": dict(rotary_dim=12, rope={"theta": 10000.0, "scaling_type": "longrope", "factor": 4.0,
                                      "original_max_position_embeddings": 16,
                                      "short_factor": (1.0, 1.1, 1.3, 1.6, 2.0, 2.5),
                                      "long_factor": (1.0, 1.5, 2.5, 4.0, 6.0, 9.0)}),
    "olmo2": dict(norm_placement="post", qk_norm="full"),
    "smollm3": dict(nope_layers=(1,)),
}


def _family_model(family):
    from tritium.backend.config import EngineConfig, Limits, ModelConfig, RopeConfig
    from tritium.backend.models.decoder import DecoderLM
    kw = dict(FAMILY_MODELS[family])
    for key in ("rope", "rope_local"):
        if key in kw:
            kw[key] = RopeConfig(**kw[key])
    m = ModelConfig(architecture=family, vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=64,
                    tie_word_embeddings=True, **kw)
    model = DecoderLM(EngineConfig(model=m, dtype="float32", limits=Limits(max_batch_size=4, max_seq_len=64,
                                                                           block_size=8)))
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.startswith("cos_sin_cache") or buf is None:
                continue
            if "norm" in name:
                buf.copy_(1 + 0.1 * torch.randn_like(buf))
            else:
                buf.copy_(torch.randn_like(buf) * (0.5 if "embed" in name else 0.15))
    return model.eval()


@pytest.mark.parametrize("family", list(FAMILY_MODELS))
def test_family_shapes_through_the_triton_kernels(family, monkeypatch):
    from test_kernels_e2e import compare_greedy, greedy
    rng, seed = new_rng()
    torch.manual_seed(seed)
    model = _family_model(family)
    lens = [rng.randint(2, 13), rng.randint(9, 20), 1 + rng.randint(1, 6)]
    prompts = [[rng.randrange(96) for _ in range(n)] for n in lens]
    chunks = [lens[0], rng.randint(1, lens[1] - 1), lens[2]]
    monkeypatch.setenv("TRITIUM_KERNELS", "reference")
    ref = greedy(model, prompts, chunks, "auto")
    monkeypatch.setenv("TRITIUM_KERNELS", "triton")
    got = greedy(model, prompts, chunks, "auto")
    compare_greedy(got, ref, "auto", f"seed={seed} family={family} prompts={lens} chunks={chunks}")


def test_softcap_changes_the_answer_where_scores_exceed_it():
    """A fixed batch with large scores: the capped kernels differ from the uncapped reference and
    equal the capped one (so the cap is applied, not dropped)."""
    from tritium.kernels.attention_metadata import AttentionMetadata
    g = torch.Generator().manual_seed(0)
    kc, vc = torch.randn(4, 16, 1, 64, generator=g) * 3, torch.randn(4, 16, 1, 64, generator=g)
    q = torch.randn(2, 2, 64, generator=g) * 3
    meta = AttentionMetadata.build([1, 1], [30, 20], [[0, 1], [2, 3]], 16)
    got = paged_decode(q, kc, vc, meta.block_tables, meta.seq_lens, 0.125, softcap=1.0)
    capped = paged_attention_ref(q, kc, vc, meta, 0.125, softcap=1.0)
    uncapped = paged_attention_ref(q, kc, vc, meta, 0.125)
    torch.testing.assert_close(got, capped, rtol=1e-5, atol=1e-5)
    assert (capped - uncapped).abs().max() > 0.1
