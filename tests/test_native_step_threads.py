"""The native decode step on several threads (one OpenMP parallel region, GEMM output channels
split between the threads, kernels/cpu_decode_layer.c) and with integer-dot W8A8 / W4A8 linears
(cpu_gemm_i8dot.c): the same bits in the hidden states, the KV cache and the logits as the per-op path on
one thread, on every CPU path (the module runs once per forced TRITIUM_CPU_ISA; ids name it).
Three threads split some GEMMs into an empty share and two uneven ones.

Oracle: the per-op path (TRITIUM_NATIVE_STEP=0) on one thread, whose kernels are tested against
the torch references in test_kernels_cpu_native.py / test_kernels_i8dot.py.
"""
from __future__ import annotations

import pytest
import torch

from tritium.backend.engine import LLMEngine
from tritium.backend.models import native_step
from tritium.backend.models.native_step import NativeStep, refusal

from tritium.kernels import ops
from tritium.kernels.attention_metadata import AttentionMetadata

from test_native_step import SHAPES, _count_native, _steps

pytestmark = pytest.mark.usefixtures("one_thread")

# int8-g32 / int4: the weight-only kernels (activation_quant none; W8A8 / W4A8 are the default, w8a8 / w4a8 here)
WEIGHTS = {"bf16": dict(deterministic=True), "int8-g32": dict(quantization="int8", group_size=32, activation_quant="none"),
           "int4": dict(quantization="int4-rtn", group_size=32, activation_quant="none"),
           "w8a8": dict(quantization="int8", group_size=32, activation_quant="int8", smoothquant=False),
           "w4a8": dict(quantization="int4-rtn", group_size=32, activation_quant="int8", smoothquant=False),
           # W4A8 linears and a tied int6 embedding: the step's head is the int6 panels (head6)
           "w4a8-emb6": dict(quantization="int4-rtn", group_size=32, embedding_quantization="int6", eval_tokens=0)}
KINDS = {"bf16": "bf16_native", "int8-g32": "int8g_native", "int4": "int4_native", "w8a8": "i8dot", "w4a8": "i8dot",
         "w4a8-emb6": "i8dot"}


@pytest.fixture(scope="module")
def engine_dir(tiny_checkpoint, tmp_path_factory):
    from tritium.builder.build import BuildOptions, build_engine
    cache = {}

    def make(shape: str, weights: str):
        if (shape, weights) not in cache:
            family, over = SHAPES[shape]
            out = str(tmp_path_factory.mktemp(f"threads-{shape}-{weights}") / "engine")
            build_engine(BuildOptions(source=tiny_checkpoint(family, **over), output=out, dtype="bfloat16",
                                      progress=False, block_size=4, **WEIGHTS[weights]))
            cache[(shape, weights)] = out
        return cache[(shape, weights)]
    return make


def _run(model, monkeypatch, native: str, threads: int, logits: bool = False):
    monkeypatch.setenv(native_step.ENV, native)
    torch.set_num_threads(threads)
    try:
        return _steps(model, seed=3, logits=logits)
    finally:
        torch.set_num_threads(1)


# granite on 3 threads: 4 rows x 1 KV head < 2 items a thread, so attention splits by query head
CASES = [("llama-gqa", "bf16", 2), ("qwen2-mha-bias", "bf16", 3), ("granite-bias-multipliers", "int8-g32", 3),
         ("llama-gqa", "w8a8", 1), ("llama-gqa", "w8a8", 2), ("qwen2-mha-bias", "w4a8", 3),
         ("llama-gqa", "int4", 2)]


@pytest.mark.parametrize("claim", ["0", "1"])  # static shares (the default) and claimed pieces
@pytest.mark.parametrize("shape,weights,threads", CASES)
def test_native_step_threads_bit_identical_to_per_op(engine_dir, shape, weights, threads, claim, native_bf16,
                                                     monkeypatch):
    eng = LLMEngine(engine_dir(shape, weights), num_kv_blocks=8, enable_prefix_caching=False)
    model = eng.runner.model
    assert refusal(model) is None, refusal(model)
    kinds = {native_step._packed(getattr(layer, n))[0].kind for layer in model.layers for n in native_step._LINEARS}
    assert kinds == {KINDS[weights]}, kinds
    # int4 scales cannot be sliced by channel: that model keeps per-op parallel regions
    assert NativeStep.get(model).native.splittable == (weights != "int4")
    ref_h, ref_kv = _run(model, monkeypatch, "0", 1)
    calls = _count_native(monkeypatch)
    monkeypatch.setenv("TRITIUM_STEP_CLAIM", claim)
    got_h, got_kv = _run(model, monkeypatch, "1", threads)
    assert calls == [8] + [4] * 12  # the 62-row prefill ran per-op, every other step natively
    for i, (a, b) in enumerate(zip(ref_h, got_h)):
        assert torch.equal(a, b), (native_bf16, shape, weights, threads, claim, i,
                                   (a.float() - b.float()).abs().max().item())
    for layer, (a, b) in enumerate(zip(ref_kv, got_kv)):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), (native_bf16, shape, weights, threads, claim, layer)


@pytest.mark.parametrize("shape,weights,threads", [("llama-gqa", "w8a8", 2), ("qwen2-mha-bias", "bf16", 3),
                                                   ("qwen2-mha-bias", "w4a8-emb6", 2)])
def test_native_head_threads_bit_identical_to_per_op(engine_dir, shape, weights, threads, native_bf16, monkeypatch):
    """The whole-step call's LM head and argmax (after the layers' parallel region) on several
    threads: compute_logits' bits and the sampler's argmax of the per-op path on one thread."""
    model = LLMEngine(engine_dir(shape, weights), num_kv_blocks=8, enable_prefix_caching=False).runner.model
    ref, _ = _run(model, monkeypatch, "0", 1, logits=True)
    got, _ = _run(model, monkeypatch, "1", threads, logits=True)
    assert [g[2] for g in got] == [False] + [True] * 13  # the prefill per-op, every other step's head native
    for i, (a, b) in enumerate(zip(ref, got)):
        assert torch.equal(a[0], b[0]) and a[1] == b[1], (native_bf16, shape, weights, threads, i)


def test_greedy_tokens_same_on_one_and_two_threads(engine_dir, native_bf16, monkeypatch):
    """Through the engine (scheduler, LM head, sampler): a request's greedy tokens and logprobs on
    two threads (native step in one parallel region) equal one thread's."""
    from tritium.backend.sampling_params import SamplingParams
    monkeypatch.setenv(native_step.ENV, "1")
    eng = LLMEngine(engine_dir("llama-gqa", "w8a8"), num_kv_blocks=16, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)
    outs = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            out = eng.generate(prompt_token_ids=[[5, 17, 923, 44, 8]], params=params)[0].outputs[0]
        finally:
            torch.set_num_threads(1)
        outs[threads] = (out.token_ids, out.logprobs)
    assert len(outs[1][0]) == 10 and outs[1] == outs[2], outs


def _one_row_steps(model, seed: int):
    """A 9-token prompt then 14 decode steps of that one sequence, block size 4: every step's hidden states and
    the KV caches. One row: the native step splits its attention by query head across threads."""
    m, bs = model.cfg.model, model.cfg.limits.block_size
    kv = [(torch.zeros(16, bs, m.num_kv_heads, m.head_dim, dtype=torch.bfloat16),
           torch.zeros(16, bs, m.num_kv_heads, m.head_dim, dtype=torch.bfloat16)) for _ in range(m.num_layers)]
    gen = torch.Generator().manual_seed(seed)
    outs = []
    for q, n in [(9, 9)] + [(1, 10 + i) for i in range(14)]:
        ids = torch.randint(3, 1000, (q,), generator=gen)
        meta = AttentionMetadata.build([q], [n], [list(range(16))], bs)
        meta.cpu_plan = ops.attention_plan(meta)
        outs.append(model(ids, torch.arange(n - q, n), kv, meta))
    return outs, kv


# claim "0": the static shares, a row's query heads cut into one run per thread (llama-gqa on 3
# threads: 1, 1 and 2 of its 4 heads, a KV head's pair split at a run's edge), with the barrier's
# prefetch on (TRITIUM_STEP_PREFETCH=256); "0-thread0": the static shares with that row's attention
# on thread 0 alone (TRITIUM_STEP_ATTN_ITEMS=0), the spin unbounded by the share; "auto": static, or claimed in the steps after a long
# barrier wait (which a busy test host may cause: either schedule must give these bits)
@pytest.mark.parametrize("shape,weights", [("llama-gqa", "w8a8"), ("qwen2-mha-bias", "bf16")])
@pytest.mark.parametrize("threads,claim", [(2, "1"), (3, "1"), (2, "0"), (3, "0"), (2, "0-thread0"), (2, "auto")])
def test_one_row_steps_bit_identical_on_threads(engine_dir, shape, weights, threads, claim, native_bf16, monkeypatch):
    """Single-stream decode steps (one row: its attention split by query head over the threads,
    GEMM channels claimed or in static shares) give the per-op path's bits on one thread, hidden
    states and KV cache."""
    model = LLMEngine(engine_dir(shape, weights), num_kv_blocks=8, enable_prefix_caching=False).runner.model
    monkeypatch.setenv(native_step.ENV, "0")
    ref_h, ref_kv = _one_row_steps(model, seed=5)
    monkeypatch.setenv(native_step.ENV, "1")
    if claim == "0":
        monkeypatch.setenv("TRITIUM_STEP_PREFETCH", "256")
    if claim == "0-thread0":
        claim = "0"
        monkeypatch.setenv("TRITIUM_STEP_ATTN_ITEMS", "0")
        monkeypatch.setenv("TRITIUM_STEP_SHARE_SPIN", "0")
    monkeypatch.setenv("TRITIUM_STEP_CLAIM", claim)
    calls = _count_native(monkeypatch)
    torch.set_num_threads(threads)
    try:
        got_h, got_kv = _one_row_steps(model, seed=5)
    finally:
        torch.set_num_threads(1)
    assert calls[-14:] == [1] * 14, calls
    for i, (a, b) in enumerate(zip(ref_h, got_h)):
        assert torch.equal(a, b), (native_bf16, shape, weights, threads, claim, i)
    for layer, (a, b) in enumerate(zip(ref_kv, got_kv)):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), (native_bf16, shape, weights, threads, layer)


def _one_row_logits(model, seed: int):
    """A 9-token prompt then 14 one-row decode steps whose row needs logits: (logits, tokens, whether
    the native call ran the head) of each."""
    from test_native_step import _step_logits
    m, bs = model.cfg.model, model.cfg.limits.block_size
    kv = [(torch.zeros(16, bs, m.num_kv_heads, m.head_dim, dtype=torch.bfloat16),
           torch.zeros(16, bs, m.num_kv_heads, m.head_dim, dtype=torch.bfloat16)) for _ in range(m.num_layers)]
    gen = torch.Generator().manual_seed(seed)
    outs = []
    for q, n in [(9, 9)] + [(1, 10 + i) for i in range(14)]:
        ids = torch.randint(3, 1000, (q,), generator=gen)
        meta = AttentionMetadata.build([q], [n], [list(range(16))], bs)
        meta.cpu_plan = ops.attention_plan(meta)
        outs.append(_step_logits(model, ids, torch.arange(n - q, n), kv, meta))
    return outs


# split "1" (the default): the head's vocabulary in one share per thread inside one parallel region,
# each thread rounding its logits and finding its maximum; "0": one GEMM of claimed panels, then the
# argmax on the calling thread (TRITIUM_STEP_HEAD_SPLIT=0, and where the layers claim: "1-claim");
# "1-warm": split, and a thread reading the first MiB of weights between steps
# (TRITIUM_STEP_WARM_MIB=1). int6 (head6), integer-dot and bf16 heads.
@pytest.mark.parametrize("split", ["1", "0", "1-warm", "1-claim"])
@pytest.mark.parametrize("shape,weights,threads", [("llama-gqa", "w8a8", 2), ("qwen2-mha-bias", "w4a8-emb6", 2),
                                                   ("qwen2-mha-bias", "bf16", 3)])
def test_one_row_head_bit_identical_on_threads(engine_dir, shape, weights, threads, split, native_bf16, monkeypatch):
    """Single-stream steps' LM head and argmax inside the native call on several threads give
    compute_logits' bits and the sampler's argmax of the per-op path on one thread."""
    model = LLMEngine(engine_dir(shape, weights), num_kv_blocks=8, enable_prefix_caching=False).runner.model
    monkeypatch.setenv(native_step.ENV, "0")
    ref = _one_row_logits(model, seed=7)
    monkeypatch.setenv(native_step.ENV, "1")
    if split == "1-warm":
        monkeypatch.setenv("TRITIUM_STEP_WARM_MIB", "1")
    if split == "1-claim":
        monkeypatch.setenv("TRITIUM_STEP_CLAIM", "1")
    split = split[0]
    monkeypatch.setenv("TRITIUM_STEP_HEAD_SPLIT", split)
    torch.set_num_threads(threads)
    try:
        got = _one_row_logits(model, seed=7)
    finally:
        torch.set_num_threads(1)
    assert all(g[2] for g in got) and not any(r[2] for r in ref)  # the 9-row prompt too: <= 32 rows
    for i, (a, b) in enumerate(zip(ref, got)):
        assert torch.equal(a[0], b[0]), (native_bf16, shape, weights, threads, split, i)
        assert a[1] == b[1], (native_bf16, shape, weights, threads, split, i)


@pytest.mark.parametrize("bad", ["65", "-1", "2.5", "x"])
def test_warm_knob_out_of_range_is_refused(engine_dir, bad, monkeypatch):
    """TRITIUM_STEP_WARM_MIB outside [0, 64] or not an integer: the step refuses before it runs, naming it."""
    model = LLMEngine(engine_dir("llama-gqa", "w8a8"), num_kv_blocks=8, enable_prefix_caching=False).runner.model
    monkeypatch.setenv(native_step.ENV, "1")
    monkeypatch.setenv("TRITIUM_STEP_WARM_MIB", bad)
    with pytest.raises(ValueError, match=r"TRITIUM_STEP_WARM_MIB must be an integer in \[0, 64\]"):
        _one_row_logits(model, seed=7)
