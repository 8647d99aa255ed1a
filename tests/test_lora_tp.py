"""LoRA adapters on a tensor-parallel engine (TP = 2 over gloo: rank 0 here, one spawned worker):
a batch mixing adapters and base rows gives the greedy tokens and logits of TP = 1 and of the
oracle Hugging Face PEFT (PeftModel, float32). Adapters are sharded like their base linears:
column-parallel qkv / gate_up split B's rows, row-parallel o / down split A's columns and add
the delta before the all-reduce (a delta counted twice, or on one rank's features only, would
change the logits far beyond 1e-4)."""
from __future__ import annotations

import pytest
import torch

from lora_utils import hf_greedy, make_peft_adapter, rel_err
from tp_utils import record_logits, tp_timeout, wait_no_workers  # noqa: F401 (fixture)
from tritium.backend.engine import LLMEngine
from tritium.backend.lora.manager import LoRAConfig
from tritium.backend.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread", "tp_timeout")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {"all8": dict(r=8, lora_alpha=16, target_modules=ALL),
            "ov4": dict(r=4, lora_alpha=8, target_modules=["o_proj", "v_proj", "down_proj"], use_rslora=True),
            "late": dict(r=6, lora_alpha=6, target_modules=["q_proj", "up_proj", "down_proj"])}
PROMPTS = [[5, 17, 99, 3, 250, 31, 7, 8, 9, 10, 11], [400, 2, 77, 13, 13, 600, 42, 42],
           [1, 600, 601, 602, 9], [77, 31, 500, 61, 3, 8]]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tiny_checkpoint, tmp_path_factory):
    from transformers import AutoModelForCausalLM
    ck = tiny_checkpoint("llama")
    oracles, paths = {}, {}
    for i, (name, kw) in enumerate(ADAPTERS.items()):
        base = AutoModelForCausalLM.from_pretrained(ck, dtype=torch.float32)
        paths[name] = str(tmp_path_factory.mktemp(f"lora-tp-{name}"))
        oracles[name] = make_peft_adapter(base, paths[name], seed=10 + i, **kw)
    return oracles, paths


def run_mix(engine, names):
    logs = record_logits(engine)
    outs = engine.generate(prompt_token_ids=PROMPTS, params=GREEDY, lora_names=names)
    return [o.outputs[0].token_ids for o in outs], logs


@pytest.mark.parametrize("max_loras", [4, 1])
def test_tp2_mixed_adapters_equal_tp1_and_peft(adapters, tiny_engine, max_loras):
    """Two adapters at start, a third added at run time (the workers get it with its first slot
    load); with max_loras 1 every adapter change reloads the one slot on both ranks."""
    oracles, paths = adapters
    names = ["all8", None, "ov4", "late"]
    start = {n: paths[n] for n in ("all8", "ov4")}
    cfg = dict(max_loras=max_loras, max_lora_rank=8)
    with LLMEngine(tiny_engine("llama", "float32"), device="cpu", num_kv_blocks=64, lora=LoRAConfig(start, **cfg)) as e1:
        e1.lora.add_adapter("late", paths["late"])
        tok1, log1 = run_mix(e1, names)
    path = tiny_engine("llama", "float32", tensor_parallel_size=2)
    with LLMEngine(path, device="cpu", threads_per_rank=1, num_kv_blocks=64, lora=LoRAConfig(start, **cfg)) as e2:
        assert len(e2.runner.workers) == 1
        e2.lora.add_adapter("late", paths["late"])
        tok2, log2 = run_mix(e2, names)
        if max_loras == 1:
            assert e2.lora.num_loads >= 3
    assert tok2 == tok1
    assert len(log1) == len(log2)
    for a, b in zip(log2, log1):
        assert a.shape == b.shape and rel_err(a, b) < 1e-4
    for name, prompt, got in zip(names, PROMPTS, tok2):
        if name is None:
            continue
        assert got == hf_greedy(oracles[name], prompt, len(got)), name
    # the adapters really change the tokens (otherwise a dropped delta would pass)
    with LLMEngine(tiny_engine("llama", "float32"), device="cpu", num_kv_blocks=64) as base:
        plain = [o.outputs[0].token_ids for o in base.generate(prompt_token_ids=PROMPTS, params=GREEDY)]
    assert sum(a != b for a, b in zip(plain, tok2)) >= 2
    assert not wait_no_workers(path), "a worker outlived close()"


def test_tp2_adapter_logits_equal_peft(adapters, tiny_engine):
    """Each step's logits at TP = 2 against PeftModel on prompt + generated tokens."""
    oracles, paths = adapters
    path = tiny_engine("llama", "float32", tensor_parallel_size=2)
    with LLMEngine(path, device="cpu", threads_per_rank=1, num_kv_blocks=64,
                   lora=LoRAConfig({"ov4": paths["ov4"]}, max_lora_rank=8)) as e2:
        logs = record_logits(e2)
        out = e2.generate(prompt_token_ids=[PROMPTS[0]], params=GREEDY, lora_names="ov4")[0].outputs[0].token_ids
    with torch.no_grad():
        ref = oracles["ov4"](torch.tensor([PROMPTS[0] + out])).logits[0]
    ours = torch.cat(logs)
    want = ref[len(PROMPTS[0]) - 1:len(PROMPTS[0]) - 1 + len(out)]
    assert ours.shape == want.shape and rel_err(ours, want) < 1e-4


def test_tp2_phi3_fused_adapters_equal_peft(tiny_checkpoint, tiny_engine, tmp_path):
    """Phi-3's adapters on its fused qkv_proj / gate_up_proj: B's rows split with the heads and
    intermediate features like the fused base weights."""
    from transformers import AutoModelForCausalLM
    ck = tiny_checkpoint("phi3")
    pm = make_peft_adapter(AutoModelForCausalLM.from_pretrained(ck, dtype=torch.float32), str(tmp_path), seed=7,
                           r=8, lora_alpha=16, target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])
    path = tiny_engine("phi3", "float32", max_seq_len=48, tensor_parallel_size=2)
    with LLMEngine(path, device="cpu", threads_per_rank=1, num_kv_blocks=64,
                   lora=LoRAConfig({"phi": str(tmp_path)}, max_lora_rank=8)) as e2:
        logs = record_logits(e2)
        outs = e2.generate(prompt_token_ids=PROMPTS[:2], params=GREEDY, lora_names=["phi", None])
    got = outs[0].outputs[0].token_ids
    assert got == hf_greedy(pm, PROMPTS[0], len(got))
    with pm.disable_adapter():
        assert outs[1].outputs[0].token_ids == hf_greedy(pm, PROMPTS[1], len(got))
    with torch.no_grad():
        ref = pm(torch.tensor([PROMPTS[0] + got])).logits[0]
    ours = torch.stack([step[0] for step in logs])
    want = ref[len(PROMPTS[0]) - 1:len(PROMPTS[0]) - 1 + len(got)]
    assert rel_err(ours, want) < 1e-4
    assert not wait_no_workers(path)
