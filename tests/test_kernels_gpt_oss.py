"""gpt-oss's kernel additions against their references, under TRITON_INTERPRET=1 and on the CPU path.

Attention sinks (a learned logit per query head in the softmax denominator): paged_attention_ref
with sinks against transformers' own gpt-oss eager attention (the oracle), then the Triton
paged-decode and varlen-prefill kernels, the mixed batch, the deterministic every-row-as-decode
route and the CPU op (its torch route with the softmax written out) against that reference, on the random paged batches of
test_kernels_attention.py (float and quantized caches, sliding windows, with soft-caps too).
The fused MoE op with expert biases, the clamped SwiGLU and MXFP4 experts: Triton and CPU paths
against moe_ref over 20 fresh shapes (experts 4-64, top-k 1-8, tokens 1-100), and the reference's
clamped SwiGLU against transformers' GptOssExperts._apply_gate on the interleaved layout.
"""
from __future__ import annotations

import kernel_env  # noqa: F401  (must precede the kernel imports: sets TRITON_INTERPRET=1)
import pytest
import torch
from kernel_env import NUM_CASES, assert_close, new_rng

from tritium.kernels.attention_cpu import paged_attention_cpu
from tritium.kernels.attention_metadata import AttentionMetadata
from tritium.kernels.attention_ref import paged_attention_ref
from tritium.kernels.moe_cpu import fused_moe_cpu
from tritium.kernels.moe_ref import QuantExperts, fused_moe_ref, swiglu_clamped_ref
from tritium.kernels.moe_triton import fused_moe
from tritium.kernels.mxfp4 import dequantize_mxfp4
from tritium.kernels.attention_decode_triton import paged_decode
from tritium.kernels.attention_prefill_triton import paged_attention
from test_kernels_attention import _prefill_lens, make_batch
from test_kernels_moe import CORNERS

NUM_SINK_CASES = 6


def _sinks(rng, hq):
    # from far below the scores (no effect) to far above them (the sink takes most of the mass)
    return torch.randn(hq) * rng.choice([0.5, 2.0]) + rng.choice([-4.0, 0.0, 3.0])


def test_reference_sinks_match_transformers_eager_attention():
    """One sequence, contiguous K/V in the paged cache, causal and sliding: paged_attention_ref
    with sinks equals transformers' gpt-oss eager_attention_forward with the same sinks."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward
    torch.manual_seed(0)
    hq, hkv, d, n, bs = 6, 2, 16, 11, 4
    q, k, v = torch.randn(n, hq, d), torch.randn(n, hkv, d), torch.randn(n, hkv, d)
    sinks = torch.randn(hq) * 2
    nblk = -(-n // bs)
    kc, vc = torch.zeros(nblk, bs, hkv, d), torch.zeros(nblk, bs, hkv, d)
    kc.view(-1, hkv, d)[:n], vc.view(-1, hkv, d)[:n] = k, v
    meta = AttentionMetadata.build([n], [n], [list(range(nblk))], bs)
    module = SimpleNamespace(sinks=sinks, num_key_value_groups=hq // hkv, training=False)
    for window in (None, 3):
        pos = torch.arange(n)
        allowed = pos[None, :] <= pos[:, None]
        if window is not None:
            allowed &= (pos[:, None] - pos[None, :]) < window
        mask = torch.zeros(n, n).masked_fill(~allowed, float("-inf"))[None, None]
        ref, _ = eager_attention_forward(module, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                         v.transpose(0, 1)[None], mask, d ** -0.5)
        ours = paged_attention_ref(q, kc, vc, meta, d ** -0.5, window, sinks=sinks)
        assert (ours - ref[0]).abs().max().item() < 1e-5, window
        plain = paged_attention_ref(q, kc, vc, meta, d ** -0.5, window)
        assert (ours - plain).abs().max().item() > 1e-2  # the sinks matter in this case


@pytest.mark.parametrize("case", range(NUM_SINK_CASES))
def test_paged_decode_sinks(case):
    rng, seed = new_rng()
    q, kc, vc, meta, ks, vs, dtype, desc = make_batch(rng, case, lambda s: 1, max_ctx=120)
    window = rng.choice([None, rng.randint(1, 40)]) if case % 2 else None
    cap = rng.uniform(0.5, 3.0) if case % 3 == 2 else None
    sinks = _sinks(rng, q.shape[1])
    scale = q.shape[-1] ** -0.5
    got = paged_decode(q, kc, vc, meta.block_tables, meta.seq_lens, scale, window, ks, vs,
                       max_seq_len=meta.max_seq_len, partition_size=(None, 16, 32, 64)[case % 4], softcap=cap,
                       sinks=sinks)
    ref = paged_attention_ref(q, kc, vc, meta, scale, window, ks, vs, softcap=cap, sinks=sinks)
    assert_close(got, ref, dtype, f"seed={seed} {desc} window={window} softcap={cap}")


@pytest.mark.parametrize("case", range(NUM_SINK_CASES))
def test_mixed_batch_sinks(case):
    """Prefill rows (varlen kernel) and decode rows (split-K kernel) with sinks; every other
    case through the deterministic route (each row a decode row)."""
    rng, seed = new_rng()
    q, kc, vc, meta, ks, vs, dtype, desc = make_batch(rng, case, _prefill_lens(rng), max_ctx=50)
    window = rng.choice([None, rng.randint(1, 30)]) if case % 2 else None
    cap = rng.uniform(0.5, 3.0) if case % 3 == 2 else None
    sinks = _sinks(rng, q.shape[1])
    meta.deterministic = case % 4 >= 2
    scale = q.shape[-1] ** -0.5
    got = paged_attention(q, kc, vc, meta, scale, window, ks, vs, softcap=cap, sinks=sinks)
    ref = paged_attention_ref(q, kc, vc, meta, scale, window, ks, vs, softcap=cap, sinks=sinks)
    assert_close(got, ref, dtype, f"seed={seed} {desc} window={window} softcap={cap} "
                                  f"deterministic={meta.deterministic}")


@pytest.mark.parametrize("case", range(NUM_SINK_CASES))
def test_cpu_attention_with_sinks(case):
    """The CPU op with sinks (off SDPA and the native kernel, which have none: decode rows in
    their SDPA groups and prefill rows in tiles with the softmax written out) against the
    reference, on float / bf16 / fp16 and quantized caches; every other case a bf16 cache, the
    native kernel's case."""
    rng, seed = new_rng()
    q, kc, vc, meta, ks, vs, dtype, desc = make_batch(rng, case, _prefill_lens(rng), max_ctx=60)
    if ks is None:  # unused slots hold zeros or stale finite values in an engine, not NaN
        kc, vc = torch.nan_to_num(kc, nan=0.0), torch.nan_to_num(vc, nan=0.0)
    if case % 2 and ks is None:
        q, kc, vc, dtype = q.bfloat16(), kc.bfloat16(), vc.bfloat16(), torch.bfloat16
    window = rng.choice([None, rng.randint(1, 30)])
    sinks = _sinks(rng, q.shape[1])
    got = paged_attention_cpu(q, kc, vc, meta, q.shape[-1] ** -0.5, window, ks, vs, sinks=sinks)
    ref = paged_attention_ref(q, kc, vc, meta, q.shape[-1] ** -0.5, window, ks, vs, sinks=sinks)
    assert_close(got, ref, dtype, f"seed={seed} {desc} window={window}")


def test_sinks_shape_is_checked():
    q, kc = torch.zeros(1, 4, 64), torch.zeros(2, 16, 2, 64)
    bt, sl = torch.zeros(1, 2, dtype=torch.int32), torch.tensor([5], dtype=torch.int32)
    with pytest.raises(ValueError, match="sinks"):
        paged_decode(q, kc, kc.clone(), bt, sl, 0.125, sinks=torch.zeros(3))


# ---- the fused MoE op: biases, clamped SwiGLU, MXFP4 experts --------------------------------

def test_clamped_swiglu_matches_transformers():
    """swiglu_clamped_ref on [gate | up] == GptOssExperts._apply_gate on the interleaved layout
    (gate = even columns, up = odd), with values beyond the limit on both sides."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    cfg = GptOssConfig(hidden_size=8, intermediate_size=6, num_local_experts=2, swiglu_limit=1.5)
    experts = GptOssExperts(cfg)
    x = torch.randn(5, 12) * 3
    ref = experts._apply_gate(x)
    ours = swiglu_clamped_ref(torch.cat([x[:, ::2], x[:, 1::2]], dim=-1), cfg.swiglu_alpha, cfg.swiglu_limit)
    assert torch.equal(ours, ref)


def _random_mxfp4(e, n, k):
    q = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8)
    s = torch.randint(120, 127, (e, n, k // 32), dtype=torch.uint8)
    return QuantExperts("mxfp4", q, s, group_size=32)


def _case(case):
    rng, seed = new_rng()
    if case < len(CORNERS):
        e, k, t = CORNERS[case]
    else:
        e = rng.choice([4, 8, 16, 32, 64])
        k = rng.randint(1, min(8, e))
        t = rng.choice([1, 2, 5, 16, 33, 100])
    t = min(t, 100)  # the 512-token corner is test_kernels_moe's; the interpreter is slow
    h, inter = rng.choice([32, 64]), rng.choice([32, 64])
    dtype = (torch.float32, torch.bfloat16, torch.float16)[case % 3]
    logits = torch.randn(t, e)
    top, ids = torch.topk(logits, k, -1)  # gpt-oss: top-k of the logits, softmax over those
    w = torch.softmax(top, -1)
    x = torch.randn(t, h).to(dtype)
    mx = case % 2 == 1
    if mx:
        w13, w2 = _random_mxfp4(e, 2 * inter, h), _random_mxfp4(e, h, inter)
    else:
        w13 = (torch.randn(e, 2 * inter, h) / h ** 0.5).to(dtype)
        w2 = (torch.randn(e, h, inter) / inter ** 0.5).to(dtype)
    b13, b2 = torch.randn(e, 2 * inter).to(dtype), torch.randn(e, h).to(dtype)
    limit = rng.choice([0.5, 2.0, 7.0])

    def act(c):
        return swiglu_clamped_ref(c, 1.702, limit)
    return x, w13, w2, w.to(dtype), ids, act, b13, b2, dtype, \
        f"seed={seed} E={e} k={k} T={t} H={h} I={inter} {dtype} mxfp4={mx} limit={limit}"


@pytest.mark.parametrize("case", range(NUM_CASES))
def test_fused_moe_biases_clamped_swiglu_and_mxfp4(case):
    x, w13, w2, w, ids, act, b13, b2, dtype, msg = _case(case)
    ref = fused_moe_ref(x, w13, w2, w, ids, act, b13, b2)
    assert_close(fused_moe(x, w13, w2, w, ids, act, b13, b2), ref, dtype, "triton " + msg)
    assert_close(fused_moe_cpu(x, w13, w2, w, ids, act, b13, b2), ref, dtype, "cpu " + msg)
    # the biases take part: without them the result differs
    assert (fused_moe_ref(x, w13, w2, w, ids, act).float() - ref.float()).abs().max() > 1e-3


def test_mxfp4_dequantization_follows_the_spec_and_transformers():
    """dequantize_mxfp4 against transformers' convert_moe_packed_tensors (which returns the
    transposed (E, K, N) parameter) and against a value table written from the OCP MX spec."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    e, n, k = 3, 8, 64
    blocks = torch.randint(0, 256, (e, n, k // 32, 16), dtype=torch.uint8)
    scales = torch.randint(100, 150, (e, n, k // 32), dtype=torch.uint8)
    ours = dequantize_mxfp4(blocks.reshape(e, n, k // 2), scales)
    hf = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert torch.equal(ours, hf.transpose(1, 2))
    spec = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # E2M1 magnitudes, OCP MX v1.0 table
    code = int(blocks[1, 2, 1, 3]) & 0xF  # element k = 32 + 6 (low nibble of byte 3 of block 1)
    val = (-1 if code & 8 else 1) * spec[code & 7] * 2.0 ** (int(scales[1, 2, 1]) - 127)
    assert ours[1, 2, 38].item() == val
