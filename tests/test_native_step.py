"""The native decode step (backend/models/native_step.py; kernels/cpu_decode_step.c: embedding
lookup, rotary rows, kernels/cpu_decode_layer.c's layers, final norm, LM head and argmax) against
the per-op path it replaces: the same bits in the final hidden states, the KV cache, the logits
and the greedy tokens, on every CPU path (the module runs once per forced TRITIUM_CPU_ISA; ids
name it), for bf16 (deterministic packing), int8 (per-channel and grouped, weight-only and W8A8)
and int4 weights, every embedding layout the C lookup reads (bf16, int8 rows, integer-dot and int6
panels, float32 / bf16 / float16 scales), every head it runs (integer-dot, centred, int6, bf16),
GQA / MQA / MHA with biases, a sliding window and Granite's multipliers, steps of one and several
rows with different context lengths crossing block boundaries, and a step that mixes a prompt
chunk with decode rows. Then the fallbacks: every model or step the native call must not take
runs the per-op path; bad ids and positions raise.

Oracle: the per-op path (TRITIUM_NATIVE_STEP=0), whose kernels are tested against the torch
references in test_kernels_cpu_native.py and whose models are tested against Hugging Face.
"""
from __future__ import annotations

import pytest
import torch

from tritium.backend.engine import LLMEngine
from tritium.backend.models import native_step
from tritium.backend.models.native_step import NATIVE_STEP_MAX_ROWS, NativeStep, refusal
from tritium.backend.sampler import argmax_rows
from tritium.kernels import cpu_native, ops
from tritium.kernels.attention_metadata import AttentionMetadata
from tritium.kernels.decode_step import (EMB_BF16, EMB_I6_PANELS, EMB_I8, EMB_I8_PANELS, EMB_NONE, HEAD_BF16,
                                         HEAD_HEAD6, HEAD_I8DOT)

from test_runtime_engine import alone, run_staggered, workload

pytestmark = pytest.mark.usefixtures("one_thread")

# Sizes the native call takes (hidden and MLP multiples of 32, head_dim 32), three attention shapes
SHAPES = {
    "llama-gqa": ("llama", dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                                head_dim=32)),
    "mistral-mqa-window": ("mistral", dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                           num_key_value_heads=1, head_dim=32, sliding_window=7)),
    "qwen2-mha-bias": ("qwen2", dict(hidden_size=64, intermediate_size=96, num_attention_heads=2,
                                     num_key_value_heads=2)),
    # the four multipliers (residual_multiplier inside the layer loop), biases on all four linears
    "granite-bias-multipliers": ("granite", dict(num_attention_heads=2, num_key_value_heads=1)),
}
# the weight-only kernels' kinds: activation_quant none (the default of int8 / int4 builds is W8A8 / W4A8)
WO = dict(activation_quant="none")
WEIGHTS = {"bf16": dict(deterministic=True), "int8": dict(quantization="int8", group_size=-1, **WO),
           "int8-g32": dict(quantization="int8", group_size=32, **WO),
           "int4": dict(quantization="int4-rtn", group_size=32, **WO),
           # the defaults of int8 / int4 builds: integer-dot W8A8 / W4A8; an int6 embedding
           "w8a8": dict(quantization="int8"), "w4a8-emb6": dict(quantization="int4-rtn", group_size=32,
                                                                embedding_quantization="int6", eval_tokens=0)}
KINDS = {"bf16": "bf16_native", "int8": "int8_native", "int8-g32": "int8g_native", "int4": "int4_native",
         "w8a8": "i8dot", "w4a8-emb6": "i8dot"}


@pytest.fixture(scope="module")
def engine_dir(tiny_checkpoint, tmp_path_factory):
    from tritium.builder.build import BuildOptions, build_engine
    cache = {}

    def make(shape: str, weights: str, **kw):
        key = (shape, weights, tuple(sorted(kw.items())))
        if key not in cache:
            family, over = SHAPES[shape]
            out = str(tmp_path_factory.mktemp(f"native-{shape}-{weights}") / "engine")
            build_engine(BuildOptions(source=tiny_checkpoint(family, **over), output=out, dtype="bfloat16",
                                      progress=False, block_size=4, **WEIGHTS.get(weights, {}), **kw))
            cache[key] = out
        return cache[key]
    return make


def _count_native(monkeypatch):
    """Rows of every step the native call ran (the whole step, or the layers alone)."""
    calls = []
    real, real_step = NativeStep.run, NativeStep.run_step

    def counted(self, hidden, *a):
        calls.append(hidden.shape[0])
        return real(self, hidden, *a)

    def counted_step(self, model, ids, *a, **k):
        out = real_step(self, model, ids, *a, **k)
        if out is not None:
            calls.append(ids.shape[0])
        return out
    monkeypatch.setattr(NativeStep, "run", counted)
    monkeypatch.setattr(NativeStep, "run_step", counted_step)
    return calls


def _step_logits(model, ids, pos, kv, meta):
    """(logits, tokens, whether the native call ran the head) of a step whose every row needs
    logits: DecoderLM.decode_logits, or where it declines, compute_logits(forward) and the
    sampler's argmax."""
    out = model.decode_logits(ids, pos, kv, meta)
    if out is not None:
        return out[0], out[1], True
    y = model.compute_logits(model(ids, pos, kv, meta))
    return y, argmax_rows(y).tolist(), False


def _steps(model, seed: int, logits: bool = False):
    """A ragged prefill of three sequences (5, 17 and 40 tokens: above the row limit, per-op), a
    mixed step (two decode rows and a 6-token chunk of a fourth prompt), then 12 decode steps of
    four rows; block size 4, so every sequence crosses blocks. Returns every step's hidden
    states and the KV caches."""
    m, bs = model.cfg.model, model.cfg.limits.block_size
    kv = [(torch.zeros(64, bs, m.num_kv_heads, m.head_dim, dtype=torch.bfloat16),
           torch.zeros(64, bs, m.num_kv_heads, m.head_dim, dtype=torch.bfloat16)) for _ in range(m.num_layers)]
    tables = [list(range(i * 16, i * 16 + 16)) for i in range(4)]
    gen = torch.Generator().manual_seed(seed)
    outs = []

    def step(qlens, slens, rows):
        ids = torch.randint(3, 1000, (sum(qlens),), generator=gen)
        pos = torch.cat([torch.arange(s - q, s) for q, s in zip(qlens, slens)])
        meta = AttentionMetadata.build(qlens, slens, [tables[r] for r in rows], bs)
        meta.cpu_plan = ops.attention_plan(meta)
        outs.append(_step_logits(model, ids, pos, kv, meta) if logits else model(ids, pos, kv, meta))

    lens = [5, 17, 40]
    step(lens, lens, [0, 1, 2])
    step([1, 6, 1], [lens[0] + 1, 6, lens[2] + 1], [0, 3, 2])  # two decode rows and a prompt chunk
    lens = [lens[0] + 1, lens[1], lens[2] + 1, 6]
    for _ in range(12):
        lens = [n + 1 for n in lens]
        step([1, 1, 1, 1], lens, [0, 1, 2, 3])
    return outs, kv


def _both_paths(model, monkeypatch):
    monkeypatch.setenv(native_step.ENV, "0")
    ref = _steps(model, seed=1)
    monkeypatch.setenv(native_step.ENV, "1")
    calls = _count_native(monkeypatch)
    got = _steps(model, seed=1)
    return ref, got, calls


# every weight kind on every attention shape would be 12 engines per path; each kind meets two shapes.
# With each, how the whole step's C lookup reads the embedding (kernels/decode_step.py EMB_*): bf16
# rows, int8 rows, the tied head's integer-dot panels, its int6 panels, or (int4) the Python lookup.
CASES = [("llama-gqa", "bf16", EMB_BF16), ("llama-gqa", "int4", EMB_NONE), ("mistral-mqa-window", "bf16", EMB_BF16),
         ("mistral-mqa-window", "int8", EMB_I8), ("qwen2-mha-bias", "int8-g32", EMB_I8_PANELS),
         ("qwen2-mha-bias", "bf16", EMB_BF16), ("llama-gqa", "int8-g32", EMB_I8),
         ("qwen2-mha-bias", "int4", EMB_I6_PANELS),
         ("llama-gqa", "int8", EMB_I8), ("granite-bias-multipliers", "bf16", EMB_BF16),
         ("granite-bias-multipliers", "int8-g32", EMB_I8), ("llama-gqa", "w8a8", EMB_I8),
         ("granite-bias-multipliers", "w8a8", EMB_I8), ("qwen2-mha-bias", "w4a8-emb6", EMB_I6_PANELS)]


@pytest.mark.parametrize("shape,weights,lookup", CASES)
def test_native_step_bit_identical_to_per_op(engine_dir, shape, weights, lookup, native_bf16, monkeypatch):
    eng = LLMEngine(engine_dir(shape, weights), num_kv_blocks=8, enable_prefix_caching=False)
    model = eng.runner.model
    assert refusal(model) is None, refusal(model)
    assert model.layers[0].qkv_proj.__class__.__name__ in ("DenseLinear", "Int8Linear", "Int4Linear")
    kinds = {native_step._packed(getattr(layer, n))[0].kind for layer in model.layers for n in native_step._LINEARS}
    assert kinds == {KINDS[weights]}, kinds
    (ref_h, ref_kv), (got_h, got_kv), calls = _both_paths(model, monkeypatch)
    assert calls == [8] + [4] * 12  # the 62-row prefill ran per-op, every other step natively
    assert NativeStep.get(model).step.front.kind == lookup, (shape, weights)
    for i, (a, b) in enumerate(zip(ref_h, got_h)):
        assert torch.equal(a, b), (native_bf16, shape, weights, i, (a.float() - b.float()).abs().max().item())
    for layer, (a, b) in enumerate(zip(ref_kv, got_kv)):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), (native_bf16, shape, weights, layer)


# (shape, weights, the head the call runs: HEAD_* or None where compute_logits runs it in Python)
HEAD_CASES = [("llama-gqa", "bf16", HEAD_BF16), ("qwen2-mha-bias", "int8-g32", HEAD_I8DOT),
              ("llama-gqa", "w8a8", HEAD_I8DOT), ("qwen2-mha-bias", "w4a8-emb6", HEAD_HEAD6),
              ("mistral-mqa-window", "int8", None), ("granite-bias-multipliers", "w8a8", None)]


@pytest.mark.parametrize("shape,weights,head", HEAD_CASES)
def test_native_head_and_argmax_bit_identical(engine_dir, shape, weights, head, native_bf16, monkeypatch):
    """Steps whose every row needs logits: the call's LM head (integer-dot, int6 or bf16; centred
    where the engine's head is) gives compute_logits' bits and the sampler's argmax; a head it does
    not run (weight-only int8, Granite's logits scaling) declines, and the Python head runs."""
    eng = LLMEngine(engine_dir(shape, weights), num_kv_blocks=8, enable_prefix_caching=False)
    model = eng.runner.model
    monkeypatch.setenv(native_step.ENV, "0")
    ref, _ = _steps(model, seed=2, logits=True)
    monkeypatch.setenv(native_step.ENV, "1")
    got, _ = _steps(model, seed=2, logits=True)
    step = NativeStep.get(model).step
    assert (step.head.kind if step.head is not None else None) == head, (shape, weights)
    assert [g[2] for g in got] == [False] + [head is not None] * 13 and not any(r[2] for r in ref)
    for i, (a, b) in enumerate(zip(ref, got)):
        assert torch.equal(a[0], b[0]), (native_bf16, shape, weights, i, (a[0] - b[0]).abs().max().item())
        assert a[1] == b[1], (native_bf16, shape, weights, i)


@pytest.mark.parametrize("shape", ["mistral-mqa-window"])
def test_engine_batched_equals_alone_with_native_step(engine_dir, shape, native_bf16, monkeypatch):
    """Batch invariance holds across the switch: steps of up to 32 rows run natively, larger
    ones per-op, and every request gets its tokens alone (one prefill, one-row decodes)."""
    monkeypatch.setenv(native_step.ENV, "1")
    engine = LLMEngine(engine_dir(shape, "bf16"), num_kv_blocks=64, enable_prefix_caching=False)
    calls = _count_native(monkeypatch)
    reqs, arrivals = workload(seed=11, n=10)
    outs = run_staggered(engine, reqs, arrivals)
    assert calls and max(calls) <= NATIVE_STEP_MAX_ROWS and any(c > 1 for c in calls)
    for (prompt, max_tokens), out in zip(reqs, outs):
        assert out.outputs[0].token_ids == alone(engine, prompt, max_tokens), (native_bf16, shape, len(prompt))


# ---------------------------------------------------------------- fallbacks
@pytest.mark.parametrize("family,over,reason", [
    ("llama", {}, "sizes"),                                   # head_dim 16, hidden 72
    ("smollm3", dict(num_attention_heads=2, num_key_value_heads=1), "RoPE"),  # NoPE layers
    ("qwen3", dict(head_dim=32), "q/k norms"),
    ("gemma2", dict(head_dim=32), "norm placement sandwich"),
    ("olmo2", {}, "norm placement post"),
])
def test_unsupported_models_refused(tiny_checkpoint, tmp_path, family, over, reason):
    from tritium.builder.build import BuildOptions, build_engine
    out = str(tmp_path / "engine")
    build_engine(BuildOptions(source=tiny_checkpoint(family, **over), output=out, dtype="bfloat16", progress=False,
                              deterministic=True))
    eng = LLMEngine(out, num_kv_blocks=16)
    why = refusal(eng.runner.model)
    assert why is not None and reason in why, why
    assert NativeStep.get(eng.runner.model) is None
    # and it still generates (the per-op path)
    assert len(eng.generate(prompt_token_ids=[[5, 6, 7]])[0].outputs[0].token_ids) > 0


@pytest.mark.parametrize("what,kw,reason", [
    ("float32", dict(dtype="float32"), "engine dtype float32"),
    ("int8 KV cache", dict(kv_cache_dtype="int8"), "KV cache"),
])
def test_unsupported_engines_refused(tiny_checkpoint, tmp_path, what, kw, reason):
    from tritium.builder.build import BuildOptions, build_engine
    family, over = SHAPES["llama-gqa"]
    out = str(tmp_path / "engine")
    opts = dict(dtype="bfloat16", deterministic=True)
    opts.update(kw)
    build_engine(BuildOptions(source=tiny_checkpoint(family, **over), output=out, progress=False, **opts))
    why = refusal(LLMEngine(out, num_kv_blocks=16).runner.model)
    assert why is not None and reason in why, (what, why)


def test_default_bf16_engine_takes_the_native_step(engine_dir, native_bf16, monkeypatch):
    """Without `deterministic`, a bf16 engine packs its dense linears for the native GEMM and its
    decode steps run natively."""
    monkeypatch.delenv("TRITIUM_CPU_ONEDNN", raising=False)
    eng = LLMEngine(engine_dir("llama-gqa", "bf16"), num_kv_blocks=8, deterministic=False)
    kinds = {native_step._packed(layer.qkv_proj)[0].kind for layer in eng.runner.model.layers}
    assert kinds == {"bf16_native"} and refusal(eng.runner.model) is None


def test_onednn_packed_bf16_refused(engine_dir, native_bf16, monkeypatch):
    """A bf16 engine whose small-K linears oneDNN runs (TRITIUM_CPU_ONEDNN=1 without
    deterministic, where oneDNN's bf16 GEMM is available) keeps the per-op path: the native call
    has no oneDNN."""
    from tritium.kernels import cpu_linear
    monkeypatch.setenv("TRITIUM_CPU_ONEDNN", "1")
    eng = LLMEngine(engine_dir("llama-gqa", "bf16"), num_kv_blocks=8, deterministic=False)
    kinds = {native_step._packed(layer.qkv_proj)[0].kind for layer in eng.runner.model.layers}
    why = refusal(eng.runner.model)
    if kinds == {"onednn"}:
        assert why is not None and "onednn" in why
    else:  # no oneDNN bf16 or no bf16 dot products (avx2, generic): the native GEMM packs every
        # weight and the step is native
        assert kinds == {"bf16_native"} and why is None
        assert not cpu_linear._onednn_packing() or not cpu_native.has_bf16_dot()


def test_steps_the_native_call_does_not_take(engine_dir, native_bf16, monkeypatch):
    """More than NATIVE_STEP_MAX_ROWS rows, TRITIUM_NATIVE_STEP=0, and a LoRA adapter in use run
    per-op; a bad TRITIUM_NATIVE_STEP names the variable and its values."""
    eng = LLMEngine(engine_dir("llama-gqa", "bf16"), num_kv_blocks=64, enable_prefix_caching=False)
    model = eng.runner.model
    step = NativeStep.get(model)
    assert step is not None
    m, bs = model.cfg.model, model.cfg.limits.block_size
    kv = [(torch.zeros(64, bs, m.num_kv_heads, m.head_dim, dtype=torch.bfloat16),) * 2 for _ in range(m.num_layers)]
    rope = model.rope_state(torch.arange(NATIVE_STEP_MAX_ROWS + 1))
    meta = AttentionMetadata.build([NATIVE_STEP_MAX_ROWS + 1], [NATIVE_STEP_MAX_ROWS + 1], [list(range(9))], bs)
    big = torch.zeros(NATIVE_STEP_MAX_ROWS + 1, m.hidden_size, dtype=torch.bfloat16)
    assert not step.takes(big, kv, meta, rope)
    small = big[:NATIVE_STEP_MAX_ROWS]
    rope = model.rope_state(torch.arange(NATIVE_STEP_MAX_ROWS))
    meta = AttentionMetadata.build([NATIVE_STEP_MAX_ROWS], [NATIVE_STEP_MAX_ROWS], [list(range(8))], bs)
    monkeypatch.setenv(native_step.ENV, "1")
    assert step.takes(small, kv, meta, rope)
    monkeypatch.setenv(native_step.ENV, "0")
    assert not step.takes(small, kv, meta, rope)
    monkeypatch.setenv(native_step.ENV, "maybe")
    with pytest.raises(ValueError, match="TRITIUM_NATIVE_STEP"):
        step.takes(small, kv, meta, rope)
    monkeypatch.setenv(native_step.ENV, "1")

    class Manager:  # a LoRA manager with adapter rows in this step (backend/lora/manager.py)
        batch = object()
    step.lora_managers = {Manager()}
    assert not step.takes(small, kv, meta, rope)


def test_lora_engine_native_only_without_adapter(engine_dir, tiny_checkpoint, tmp_path, native_bf16, monkeypatch):
    """An engine that serves LoRA adapters takes the native call in steps where no request uses
    an adapter, and the per-op path (which adds the deltas) where one does: tokens with and
    without the adapter equal TRITIUM_NATIVE_STEP=0's."""
    from transformers import AutoModelForCausalLM
    from tritium.backend.lora.manager import LoRAConfig
    from tritium.backend.sampling_params import SamplingParams
    from lora_utils import make_peft_adapter
    family, over = SHAPES["llama-gqa"]
    base = AutoModelForCausalLM.from_pretrained(tiny_checkpoint(family, **over), dtype=torch.float32)
    make_peft_adapter(base, str(tmp_path / "a"), r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    tokens = {}
    for mode in ("0", "1"):
        monkeypatch.setenv(native_step.ENV, mode)
        eng = LLMEngine(engine_dir("llama-gqa", "bf16"), num_kv_blocks=32, enable_prefix_caching=False,
                        lora=LoRAConfig({"a": str(tmp_path / "a")}, max_lora_rank=8))
        calls = _count_native(monkeypatch)
        for lora in (None, "a"):
            params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, lora_name=lora)
            out = eng.generate(prompt_token_ids=[[5, 17, 923, 44]], params=params)[0]
            tokens[(mode, lora)] = out.outputs[0].token_ids
            if mode == "1":
                assert (len(calls) > 0) == (lora is None), (lora, calls)
                calls.clear()
        monkeypatch.undo()  # the env and the counting patch (the forced ISA path is the fixture's)
    assert tokens[("1", None)] == tokens[("0", None)] and tokens[("1", "a")] == tokens[("0", "a")]
    assert tokens[("0", "a")] != tokens[("0", None)]  # the adapter changes the answer: the deltas ran


def test_bad_ids_and_positions_raise(engine_dir, native_bf16, monkeypatch):
    """An id outside the vocabulary or a position past the rotary table raises IndexError naming
    it, as the per-op path's lookups do."""
    monkeypatch.setenv(native_step.ENV, "1")
    eng = LLMEngine(engine_dir("llama-gqa", "int8"), num_kv_blocks=8, enable_prefix_caching=False)
    model = eng.runner.model
    m, bs = model.cfg.model, model.cfg.limits.block_size
    kv = [(torch.zeros(8, bs, m.num_kv_heads, m.head_dim, dtype=torch.bfloat16),) * 2 for _ in range(m.num_layers)]
    meta = AttentionMetadata.build([1], [1], [[0]], bs)
    meta.cpu_plan = ops.attention_plan(meta)
    step = NativeStep.get(model)
    bad = ((m.vocab_size, 0, "token id"), (-1, 0, "token id"), (5, model.cos_sin_cache.shape[0], "position"))
    for ids, pos, what in bad:
        with pytest.raises(IndexError, match=what):
            step.run_step(model, torch.tensor([ids]), torch.tensor([pos]), kv, meta)
    out = step.run_step(model, torch.tensor([5]), torch.tensor([0]), kv, meta)
    assert out.shape == (1, m.hidden_size) and torch.isfinite(out.float()).all()



def test_head_and_embedding_follow_swapped_modules(engine_dir, native_bf16, monkeypatch):
    """_set_head / _set_embedding re-point the call only when what they read changed (checked every
    step without calling the packing code): a W8A8 model whose head and embedding modules are then
    swapped for a bf16 engine's (same shape, other weights) runs the bf16 head and lookup, and its
    logits and tokens equal the per-op path's on the swapped model; steps in between keep them."""
    model = LLMEngine(engine_dir("llama-gqa", "w8a8"), num_kv_blocks=8, enable_prefix_caching=False).runner.model
    other = LLMEngine(engine_dir("llama-gqa", "bf16"), num_kv_blocks=8, enable_prefix_caching=False).runner.model
    monkeypatch.setenv(native_step.ENV, "1")
    before, _ = _steps(model, seed=4, logits=True)
    step = NativeStep.get(model).step
    assert (step.head.kind, step.front.kind) == (HEAD_I8DOT, EMB_I8)
    for name in ("lm_head", "embed_tokens", "embed_tokens_weight", "embed_input_scale", "head_input_mean",
                 "head_mean_logits", "packed_head"):
        v = getattr(other, name, None)
        if name in model._buffers:
            model._buffers[name] = v
        elif name in model._modules:
            model._modules[name] = v
        else:
            setattr(model, name, v)
    got, _ = _steps(model, seed=4, logits=True)
    assert NativeStep.get(model).step is step  # the same call (its layers did not change), re-pointed
    assert (step.head.kind, step.front.kind) == (HEAD_BF16, EMB_BF16)
    monkeypatch.setenv(native_step.ENV, "0")
    ref, _ = _steps(model, seed=4, logits=True)
    assert [g[2] for g in got] == [False] + [True] * 13
    for i, (a, b) in enumerate(zip(ref, got)):
        assert torch.equal(a[0], b[0]), (native_bf16, i, (a[0] - b[0]).abs().max().item())
        assert a[1] == b[1], (native_bf16, i)
    assert not torch.equal(before[-1][0], got[-1][0])  # the swap changed the answer
