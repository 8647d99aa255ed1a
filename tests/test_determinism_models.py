"""Batch invariance on the tiny HF-parity models in bfloat16 (odd sizes: head_dim 16 / 18, hidden
72), and tensor parallelism with quantized weights in float32 engines (docs/determinism.md).

Oracle: the engine's own tokens for each prompt alone on a cold cache; for TP, the TP = 1 engine
built from the same checkpoint (its logits are also checked against the float32 reference
within 1e-4, as float weights are in test_parallel_engine.py).
"""
from __future__ import annotations

import pytest

from tritium.backend.engine import LLMEngine
from tritium.backend.sampling_params import SamplingParams

from test_runtime_engine import alone, run_staggered, workload
from tp_utils import record_logits, tp_timeout  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("mode", ["batched", "preempt", "chunks", "prefix"])
def test_bf16_tiny_models_batched_equals_alone(tiny_engine, family, mode, native_bf16):
    kw = {"batched": dict(num_kv_blocks=64, enable_prefix_caching=False),
          "preempt": dict(num_kv_blocks=16, enable_prefix_caching=False),
          "chunks": dict(num_kv_blocks=64, max_num_batched_tokens=5, enable_prefix_caching=False),
          "prefix": dict(num_kv_blocks=128)}[mode]
    engine = LLMEngine(tiny_engine(family, "bfloat16", block_size=4 if mode == "preempt" else 16),
                       device="cpu", **kw)
    reqs, arrivals = workload(seed=3 + len(family))
    if mode == "prefix":  # every prompt shares a 20-token system prefix, asked twice
        reqs = [(list(range(40, 60)) + p, n) for p, n in reqs]
        run_staggered(engine, reqs, arrivals)
    outs = run_staggered(engine, reqs, arrivals)
    for (prompt, max_tokens), out in zip(reqs, outs):  # alone: one prefill, then one-row decodes
        assert out.outputs[0].token_ids == alone(engine, prompt, max_tokens), (family, mode, len(prompt))
    st = engine.stats()
    if mode == "preempt":
        assert st["preemptions"] > 0
    if mode == "prefix":
        assert st["prefix_cache_hit_tokens"] > 0


PROMPTS = [[5, 17, 923, 44, 300, 2, 81, 999, 13, 640, 7, 7, 7, 250, 18, 402, 77, 31, 500, 61, 3],
           [1, 600, 601, 602], [999]]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.mark.usefixtures("tp_timeout")
@pytest.mark.parametrize("quant", ["int8", "int4-rtn"])
def test_quantized_float32_tp2_equals_tp1(tiny_checkpoint, tmp_path, quant):
    """A float32 engine's int8 / int4 GEMMs run and return float32 (kernels/cpu_linear.py), so the
    row-parallel partial sums are never rounded to bfloat16: TP = 2 gives TP = 1's tokens, and
    every step's logits within 1e-4 (relative L2), as float weights do."""
    from tritium.builder.build import BuildOptions, build_engine
    ckpt = tiny_checkpoint("llama", hidden_size=96, intermediate_size=128)
    dirs = {}
    for n in (1, 2):
        dirs[n] = str(tmp_path / f"tp{n}")
        build_engine(BuildOptions(source=ckpt, output=dirs[n], dtype="float32", progress=False,
                                  quantization=quant, group_size=32 if quant.startswith("int4") else None,
                                  tensor_parallel_size=n))
    toks, logs = {}, {}
    for n in (1, 2):
        kw = {"threads_per_rank": 1} if n > 1 else {}
        with LLMEngine(dirs[n], device="cpu", num_kv_blocks=64, **kw) as eng:
            logs[n] = record_logits(eng)
            toks[n] = [o.outputs[0].token_ids for o in eng.generate(prompt_token_ids=PROMPTS, params=GREEDY)]
            lin = eng.runner.model.layers[0].down_proj
            y = lin(eng.runner.model.norm_weight.new_ones(2, lin.in_features))
            assert y.dtype.is_floating_point and y.dtype == eng.runner.model.norm_weight.dtype  # float32
    assert toks[2] == toks[1]
    assert len(logs[1]) == len(logs[2])
    for a, b in zip(logs[2], logs[1]):
        assert ((a - b).norm() / b.norm()).item() < 1e-4


def test_deterministic_option_packs_every_dense_weight_for_the_native_gemm(tiny_engine, native_bf16):
    path = tiny_engine("llama", "bfloat16")
    with LLMEngine(path, device="cpu", num_kv_blocks=64, deterministic=True) as eng:
        assert eng.config.deterministic
        layer = eng.runner.model.layers[0]
        kinds = {lin.packed_weight.kind for lin in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)}
        assert kinds == {"bf16_native"}
        reqs, arrivals = workload(seed=11)
        for (prompt, max_tokens), out in zip(reqs, run_staggered(eng, reqs, arrivals)):
            assert out.outputs[0].token_ids == alone(eng, prompt, max_tokens)
    with LLMEngine(path, device="cpu", num_kv_blocks=64) as eng:
        # the default packs every dense weight for the native GEMM too (oneDNN only on request)
        assert eng.runner.model.layers[0].qkv_proj.packed_weight.kind == "bf16_native"
    with pytest.raises(ValueError, match="deterministic must be true or false"):
        LLMEngine(path, device="cpu", num_kv_blocks=8, deterministic="yes")
