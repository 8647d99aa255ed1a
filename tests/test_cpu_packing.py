"""oneDNN pre-packed bf16 weights (DecoderLM.pack_for_cpu, used by the engine on CPU) compute
the same linears and logits as torch's F.linear on the plain weights. On a CPU without native
bf16 in oneDNN the layers keep F.linear, and the same comparisons hold."""
import pytest
import torch

from tritium.backend.engine import LLMEngine
from tritium.backend.loader import load_engine
from tritium.backend.models.linear import DenseLinear, cpu_packing_supported
from tritium.backend.sampling_params import SamplingParams


def test_packing_applies_only_to_bf16_on_cpu():
    assert not cpu_packing_supported(torch.zeros(2, 2, dtype=torch.float32))
    lin = DenseLinear(8, 8, False, torch.float32)
    assert lin.pack_for_cpu() is False and lin.weight is not None


@pytest.mark.parametrize("bias", [False, True])
def test_packed_dense_linear_equals_f_linear(bias, cpu_path):
    """On each native CPU path the native bf16 GEMM packs a dense weight (oneDNN only with
    TRITIUM_CPU_ONEDNN=1, tests/test_determinism_kernels.py)."""
    torch.manual_seed(0)
    lin = DenseLinear(96, 160, bias, torch.bfloat16)
    lin.weight.copy_(torch.randn(160, 96))
    if bias:
        lin.bias.copy_(torch.randn(160))
    w, b = lin.weight.clone(), None if lin.bias is None else lin.bias.clone()
    # On a CPU without native bf16 in oneDNN the layer keeps F.linear; both must compute the same.
    supported = cpu_packing_supported(lin.weight)
    assert lin.pack_for_cpu() is supported and lin.pack_for_cpu() is supported  # idempotent
    assert (lin.weight is None) is supported  # packed: the plain weight is released, not kept twice
    assert lin.packed_weight.kind == "bf16_native"
    for rows in (1, 7, 64):
        x = torch.randn(rows, 96, dtype=torch.bfloat16)
        ref = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
        torch.testing.assert_close(lin(x).float(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_packed_model_logits_and_greedy_match_unpacked(tiny_engine, family):
    engine_dir = tiny_engine(family, dtype="bfloat16")
    _, plain, _ = load_engine(engine_dir, "cpu")
    _, packed, _ = load_engine(engine_dir, "cpu")
    assert (packed.pack_for_cpu() > 0) is cpu_packing_supported(torch.zeros(1, dtype=torch.bfloat16))
    torch.manual_seed(1)
    hidden = torch.randn(5, plain.cfg.model.hidden_size, dtype=torch.bfloat16)
    torch.testing.assert_close(packed.compute_logits(hidden), plain.compute_logits(hidden), rtol=2e-2, atol=2e-2)
    # Whole engines: greedy tokens of the packed engine (what LLMEngine does on CPU) agree with
    # an engine over the plain model, whose runner is told not to pack.
    prompts = [[5, 17, 42, 7, 99, 3], [11, 12, 13]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in LLMEngine(engine_dir, device="cpu").generate(
        prompt_token_ids=prompts, params=params)]
    plain.pack_for_cpu = lambda: 0  # keep this one on F.linear
    cfg = plain.cfg
    want = [o.outputs[0].token_ids for o in LLMEngine.from_model(cfg, plain).generate(
        prompt_token_ids=prompts, params=params)]
    agree = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w)) / sum(map(len, want))
    assert agree >= 0.9, (got, want)
