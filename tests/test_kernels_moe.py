"""The fused MoE op (kernels/moe_*.py) against its torch reference (moe_ref.fused_moe_ref).

The Triton grouped-GEMM kernel runs under Triton's interpreter, the CPU path as it is, over
fresh random shapes per run: experts 4-64, top-k 1-8, tokens 1-512 (small hidden / intermediate
sizes keep the interpreter to seconds). Experts that no token picks hold NaN weights, so a path
that touches an idle expert fails.
"""
from __future__ import annotations

import kernel_env  # noqa: F401  (must precede the kernel imports: sets TRITON_INTERPRET=1)
import pytest
import torch
import torch.nn.functional as F
from kernel_env import NUM_CASES, assert_close, new_rng

from tritium.kernels.moe_cpu import fused_moe_cpu
from tritium.kernels.moe_ref import QuantExperts, fused_moe_ref, moe_align
from tritium.kernels.moe_triton import fused_moe
from tritium.kernels.silu_mul_ref import silu_mul_ref

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# (experts, top_k, tokens): the corners first, then random draws
CORNERS = [(4, 1, 1), (64, 2, 512), (8, 2, 1), (16, 4, 37), (64, 1, 3), (32, 8, 64)]


def gelu_tanh_mul(x):
    n = x.shape[-1] // 2
    return F.gelu(x[..., :n], approximate="tanh") * x[..., n:]


def _case(case):
    rng, seed = new_rng()
    if case < len(CORNERS):
        e, k, t = CORNERS[case]
    else:
        e = rng.choice([4, 8, 16, 32, 64])
        k = rng.randint(1, min(8, e))
        t = rng.choice([1, 2, 5, 16, 33, 100])
    h, inter = rng.choice([16, 32, 48]), rng.choice([16, 24, 40])
    dtype = DTYPES[case % 3]
    # routing: top-k of random scores, weights renormalized (or not)
    scores = torch.randn(t, e)
    if case % 4 == 1:  # skewed: a few experts take most tokens, many take none
        scores[:, : max(k, e // 4)] += 4.0
    w, ids = torch.topk(torch.softmax(scores, -1), k, -1)
    if case % 2:
        w = w / w.sum(-1, keepdim=True)
    x = torch.randn(t, h).to(dtype)
    w13 = (torch.randn(e, 2 * inter, h) / h ** 0.5).to(dtype)
    w2 = (torch.randn(e, h, inter) / inter ** 0.5).to(dtype)
    idle = torch.ones(e, dtype=torch.bool)
    idle[ids.unique()] = False
    w13[idle], w2[idle] = float("nan"), float("nan")
    act = gelu_tanh_mul if case % 5 == 4 else silu_mul_ref
    return x, w13, w2, w.to(dtype), ids, act, dtype, f"seed={seed} E={e} k={k} T={t} H={h} I={inter} {dtype}"


@pytest.mark.parametrize("case", range(NUM_CASES + 4))
def test_fused_moe_triton_matches_reference(case):
    x, w13, w2, w, ids, act, dtype, msg = _case(case)
    ref = fused_moe_ref(x, w13, w2, w, ids, act)
    assert_close(fused_moe(x, w13, w2, w, ids, act), ref, dtype, msg)


@pytest.mark.parametrize("case", range(NUM_CASES + 4))
def test_fused_moe_cpu_matches_reference(case):
    x, w13, w2, w, ids, act, dtype, msg = _case(case)
    ref = fused_moe_ref(x, w13, w2, w, ids, act)
    assert_close(fused_moe_cpu(x, w13, w2, w, ids, act), ref, dtype, msg)


def test_moe_align_groups_pairs_by_expert():
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 2]])
    sorted_ids, block_expert = moe_align(ids, num_experts=6, block_m=4)
    n = ids.numel()
    # experts 0 (2 pairs), 1, 2 (1 each), 3 (4 pairs) -> four blocks of 4, the rest unused
    assert block_expert.tolist()[:4] == [0, 1, 2, 3] and set(block_expert.tolist()[4:]) <= {-1}
    flat = ids.reshape(-1)
    for b, e in enumerate(block_expert.tolist()[:4]):
        rows = [r for r in sorted_ids[4 * b: 4 * b + 4].tolist() if r != n]
        assert rows and all(flat[r] == e for r in rows)
    real = sorted(r for r in sorted_ids.tolist() if r != n)
    assert real == list(range(n))  # every pair exactly once


def test_cpu_path_visits_only_routed_experts(monkeypatch):
    """A decode step with 64 experts and top-2 runs two expert GEMM pairs, not 64."""
    calls = []
    real = F.linear
    monkeypatch.setattr("tritium.kernels.moe_cpu.F.linear", lambda a, b, *r: calls.append(1) or real(a, b, *r))
    x = torch.randn(1, 16)
    ids = torch.tensor([[5, 40]])
    out = fused_moe_cpu(x, torch.randn(64, 32, 16), torch.randn(64, 16, 16), torch.tensor([[0.7, 0.3]]), ids)
    assert out.shape == (1, 16) and len(calls) == 4


def _quantized(w: torch.Tensor, method: str, group: int = 8) -> QuantExperts:
    """Each expert through the builder's own RTN quantizers, stacked."""
    from tritium.builder.quant.quantize_int4 import quantize_int4
    from tritium.builder.quant.quantize_int8 import quantize_int8
    parts = [quantize_int8(w[e]) if method == "int8" else quantize_int4(w[e], group) for e in range(w.shape[0])]
    stack = [torch.stack([p[j] for p in parts]) for j in range(len(parts[0]))]
    return QuantExperts(method, *stack, group_size=None if method == "int8" else group)


@pytest.mark.parametrize("case", range(NUM_CASES))
def test_quantized_experts_match_reference(case):
    """int8 (Triton kernel, interpreted, and CPU path) and int4 (CPU path) experts against the
    reference on the dequantized weights; the reference's dequantization against the builder's."""
    from tritium.builder.quant.quantize_int8 import dequantize_int8
    x, w13, w2, w, ids, act, dtype, msg = _case(case)
    w13, w2 = torch.nan_to_num(w13.float()), torch.nan_to_num(w2.float())
    method = ("int8", "int4")[case % 2]
    q13, q2 = _quantized(w13, method), _quantized(w2, method)
    if method == "int8":
        assert torch.equal(q13.expert(1), dequantize_int8(q13.qweight[1], q13.scales[1]))
    ref = fused_moe_ref(x, q13, q2, w, ids, act)
    assert_close(fused_moe_cpu(x, q13, q2, w, ids, act), ref, dtype, f"{method} cpu {msg}")
    if method == "int8":
        assert_close(fused_moe(x, q13, q2, w, ids, act), ref, dtype, f"int8 triton {msg}")
    # the quantized op is close to the float one (RTN error only)
    flt = fused_moe_ref(x, w13, w2, w, ids, act).float()
    err = ((ref.float() - flt).norm() / flt.norm().clamp_min(1e-6)).item()
    assert err < (0.05 if method == "int8" else 0.35), f"{method} rel err {err:.3g} {msg}"


@pytest.mark.parametrize("case", range(NUM_CASES))
def test_fp8_experts_match_reference(case):
    """fp8 experts (E4M3 codes, one float32 scale per output channel of each expert, the builder's
    quantize_fp8 per expert): the Triton kernel (interpreted) and the CPU path against the reference
    on the dequantized weights; each expert's dequantization equals the builder's."""
    from tritium.builder.quant.quantize_fp8 import dequantize_fp8, quantize_fp8
    x, w13, w2, w, ids, act, dtype, msg = _case(case)
    w13, w2 = torch.nan_to_num(w13.float()), torch.nan_to_num(w2.float())

    def q(t):
        parts = [quantize_fp8(t[e]) for e in range(t.shape[0])]
        return QuantExperts("fp8", torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    q13, q2 = q(w13), q(w2)
    assert q13.qweight.dtype == torch.float8_e4m3fn and q13.shape == tuple(w13.shape)
    assert torch.equal(q2.expert(0), dequantize_fp8(q2.qweight[0], q2.scales[0]))
    ref = fused_moe_ref(x, q13, q2, w, ids, act)
    assert_close(fused_moe_cpu(x, q13, q2, w, ids, act), ref, dtype, f"fp8 cpu {msg}")
    assert_close(fused_moe(x, q13, q2, w, ids, act), ref, dtype, f"fp8 triton {msg}")
    flt = fused_moe_ref(x, w13, w2, w, ids, act).float()
    err = ((ref.float() - flt).norm() / flt.norm().clamp_min(1e-6)).item()
    assert err < 0.1, f"fp8 rel err {err:.3g} {msg}"
