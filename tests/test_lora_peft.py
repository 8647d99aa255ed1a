"""LoRA adapters against the oracle Hugging Face PEFT 0.21 (PeftModel on the same base, and
merge_and_unload): fp32 logits and greedy tokens on tiny random Llama / Qwen2 / Mistral bases with
random adapters (several ranks, target sets, rsLoRA, rank / alpha patterns); mixed batches; the
prefix cache keyed by adapter; quantized bases; speculative decoding; tensorrtllm_backend tensors."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from lora_utils import engine_logits, hf_greedy, make_peft_adapter, rel_err
from tritium.backend.engine import LLMEngine
from tritium.backend.lora.manager import LoRAConfig
from tritium.backend.sampling_params import SamplingParams
from tritium.backend.speculative.config import SpeculativeConfig

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# family -> adapters (name -> PEFT LoraConfig arguments): ranks 2..16, different target sets
ADAPTERS = {
    "llama": {"all8": dict(r=8, lora_alpha=16, target_modules=ALL),
              "qv4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_rslora=True),
              "mlp16": dict(r=16, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"]),
              "mixed": dict(r=6, lora_alpha=12, target_modules=["k_proj", "o_proj", "up_proj"],
                            rank_pattern={"o_proj": 2}, alpha_pattern={"up_proj": 3.0})},
    "qwen2": {"qkvo": dict(r=4, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                           use_rslora=True)},
    "mistral": {"all-linear": dict(r=12, lora_alpha=24, target_modules="all-linear"),
                "layer1": dict(r=3, lora_alpha=5, target_modules=["v_proj", "down_proj"], layers_to_transform=[1])},
}
PROMPTS = [[5, 17, 99, 3, 250, 31, 7, 8, 9, 10, 11], [400, 2, 77, 13, 13, 600, 42, 42, 42, 5, 1, 9, 300, 21, 8, 8, 64]]
GREEDY = SamplingParams(max_tokens=12, temperature=0)


@pytest.fixture(scope="module")
def family_setup(tiny_checkpoint, tiny_engine, tmp_path_factory, one_thread):
    """family -> (engine with its adapters, {name: PeftModel oracle})."""
    from transformers import AutoModelForCausalLM
    cache = {}

    def make(family):
        if family not in cache:
            ck = tiny_checkpoint(family)
            oracles, paths = {}, {}
            for i, (name, kw) in enumerate(ADAPTERS[family].items()):
                base = AutoModelForCausalLM.from_pretrained(ck, dtype=torch.float32)
                paths[name] = str(tmp_path_factory.mktemp(f"lora-{family}-{i}"))
                oracles[name] = make_peft_adapter(base, paths[name], seed=i, **kw)
            eng = LLMEngine(tiny_engine(family), device="cpu", lora=LoRAConfig(paths, max_lora_rank=16))
            cache[family] = (eng, oracles, paths)
        return cache[family]
    return make


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_logits_and_greedy_match_peft(family, family_setup):
    eng, oracles, _ = family_setup(family)
    for name, pm in oracles.items():
        for ids in PROMPTS:
            with torch.no_grad():
                ref = pm(torch.tensor([ids])).logits[0]
                with pm.disable_adapter():
                    base = pm(torch.tensor([ids])).logits[0]
            ours = engine_logits(eng, ids, name)
            assert rel_err(base, ref) > 1e-2, f"{name}: the adapter barely changes the model; the test would not see it"
            assert rel_err(ours, ref) < 1e-4, (family, name)
            out = eng.generate(prompt_token_ids=[ids], params=GREEDY, lora_names=name)[0]
            assert out.outputs[0].token_ids == hf_greedy(pm, ids, 12), (family, name)


def test_merge_and_unload_agrees(family_setup):
    """PEFT's merged weights (W + scale B A) give the logits the engine computes unmerged."""
    eng, oracles, paths = family_setup("llama")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(oracles["mixed"].base_model.model.config._name_or_path,
                                                dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, paths["mixed"]).merge_and_unload().eval()
    ids = PROMPTS[1]
    with torch.no_grad():
        ref = merged(torch.tensor([ids])).logits[0]
    assert rel_err(engine_logits(eng, ids, "mixed"), ref) < 1e-4


@pytest.mark.parametrize("max_loras", [4, 2])
def test_mixed_batch_rows_get_their_tokens_alone(family_setup, tiny_engine, max_loras):
    """4 adapters and base-only rows in one batch: each row gets what it gets alone. With
    max_loras 2 the scheduler holds back rows whose adapter finds no slot, and slots are reused."""
    eng, _, paths = family_setup("llama")
    names = [None, "all8", "qv4", None, "mlp16", "mixed", "all8", None]
    prompts = [PROMPTS[i % 2][:8 + i] for i in range(len(names))]
    alone = [eng.generate(prompt_token_ids=[p], params=GREEDY, lora_names=n)[0].outputs[0].token_ids
             for p, n in zip(prompts, names)]
    mixed_eng = LLMEngine(tiny_engine("llama"), device="cpu", num_kv_blocks=64,
                          lora=LoRAConfig(paths, max_loras=max_loras, max_lora_rank=16))
    outs = mixed_eng.generate(prompt_token_ids=prompts, params=GREEDY, lora_names=names)
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert len(set(map(tuple, alone))) >= 5  # the adapters really differ
    if max_loras == 2:
        assert mixed_eng.lora.num_loads > 2


def test_prefix_cache_never_shares_kv_between_adapters(family_setup):
    eng, _, _ = family_setup("llama")
    ids = list(range(100, 150))  # several full blocks, a prompt no other test sends
    bm = eng.block_manager
    first = eng.generate(prompt_token_ids=[ids], params=GREEDY, lora_names="all8")[0].outputs[0].token_ids
    hits = bm.num_prefix_hit_tokens
    other = eng.generate(prompt_token_ids=[ids], params=GREEDY, lora_names="qv4")[0].outputs[0].token_ids
    assert bm.num_prefix_hit_tokens == hits, "a different adapter reused another adapter's KV blocks"
    base = eng.generate(prompt_token_ids=[ids], params=GREEDY)[0].outputs[0].token_ids
    assert bm.num_prefix_hit_tokens == hits, "the base model reused an adapter's KV blocks"
    again = eng.generate(prompt_token_ids=[ids], params=GREEDY, lora_names="all8")[0].outputs[0].token_ids
    assert bm.num_prefix_hit_tokens > hits and again == first  # the same adapter does reuse its own
    assert first != other and first != base


def test_quantized_base_takes_the_delta(tiny_checkpoint, tiny_engine, family_setup):
    """int8 and fp8 bases: the delta is added to the quantized linear's output; logits follow PEFT
    on the float base within the quantization's own error, and differ from the base's."""
    _, oracles, paths = family_setup("llama")
    pm, ids = oracles["all8"], PROMPTS[1]
    with torch.no_grad():
        ref = pm(torch.tensor([ids])).logits[0]
    for quant in ("int8", "fp8"):
        # the embedding stays float (int8 / fp8 builds quantize it by default): the delta acts
        # on the linears, whose quantization error is what the bound below is about; weight-only
        # numerics (activation_quant none: the bound is the weights' error; a default int8 build is
        # smoothed, which takes no adapters: test_activation_default.py)
        eng = LLMEngine(tiny_engine("llama", quantization=quant, group_size=-1, eval_tokens=0,
                                    embedding_quantization="none", activation_quant="none"),
                        device="cpu", lora=LoRAConfig({"all8": paths["all8"]}))
        base_err = rel_err(engine_logits(eng, ids), ref)
        err = rel_err(engine_logits(eng, ids, "all8"), ref)
        # the quantized base's own error (fp8 E4M3 keeps 3 mantissa bits) bounds the agreement
        assert err < {"int8": 5e-2, "fp8": 0.25}[quant] and err < base_err / 5, (quant, err, base_err)


def test_speculative_decoding_keeps_the_adapters_tokens(family_setup, tiny_engine):
    """n-gram and draft speculation (the draft runs the base model) give the adapter's greedy tokens."""
    eng, oracles, paths = family_setup("llama")
    ids = PROMPTS[0] * 2
    want = hf_greedy(oracles["all8"], ids, 12)
    always = float("inf")  # step_overhead_tokens: never switch speculation off
    for spec in (SpeculativeConfig("ngram", num_speculative_tokens=3, step_overhead_tokens=always),
                 SpeculativeConfig("draft", num_speculative_tokens=3, draft_engine_dir=tiny_engine("llama"),
                                   step_overhead_tokens=always)):
        s = LLMEngine(tiny_engine("llama"), device="cpu", speculative=spec, lora=LoRAConfig(paths, max_lora_rank=16))
        out = s.generate(prompt_token_ids=[ids], params=GREEDY, lora_names="all8")[0].outputs[0].token_ids
        assert out == want, spec.method
        if spec.method == "draft":  # (prompt lookup proposes only where the output repeats the context)
            assert s.speculator.stats()["spec_proposed_tokens"] > 0


def trtllm_tensors(path: str, alpha_over_r: bool = True):
    """A PEFT folder in tensorrtllm_backend's lora_weights / lora_config layout, as TensorRT-LLM's
    hf_lora_convert.py writes it: rows A.flatten() ++ (scale * B).flatten(), zero-padded."""
    import json
    import os

    from safetensors.torch import load_file
    ids = {"q_proj": 1, "k_proj": 2, "v_proj": 3, "o_proj": 4, "gate_proj": 5, "down_proj": 6, "up_proj": 7}
    cfg = json.load(open(os.path.join(path, "adapter_config.json")))
    t = load_file(os.path.join(path, "adapter_model.safetensors"))
    rows, config = [], []
    for key in sorted(t):
        if ".lora_A." not in key:
            continue
        layer, module = int(key.split(".layers.")[1].split(".")[0]), key.split(".lora_A.")[0].split(".")[-1]
        a, b = t[key], t[key.replace("lora_A", "lora_B")]
        r = a.shape[0]
        scale = cfg["lora_alpha"] / (r ** 0.5 if cfg.get("use_rslora") else r)
        rows.append(torch.cat([a.flatten(), (b * scale).flatten()]))
        config.append([ids[module], layer, r])
    width = max(len(r) for r in rows)
    w = torch.stack([torch.nn.functional.pad(r, (0, width - len(r))) for r in rows]).numpy().astype(np.float16)
    return w[None], np.array(config, dtype=np.int32)[None]


def test_trtllm_task_tensors_give_the_named_adapters_tokens(family_setup):
    eng, oracles, paths = family_setup("llama")
    w, c = trtllm_tensors(paths["qv4"])
    eng.lora.register_task(7, w, c)
    ids = PROMPTS[0]
    by_task = None
    eng.add_request("task-7", prompt_token_ids=ids, params=GREEDY, lora_task_id=7)
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                by_task = out.outputs[0].token_ids
    assert by_task == hf_greedy(oracles["qv4"], ids, 12)  # fp16 tensors: same greedy tokens
    with pytest.raises(ValueError, match="lora_task_id 8 is not in the LoRA cache"):
        eng.add_request("task-8", prompt_token_ids=ids, params=GREEDY, lora_task_id=8)
    with pytest.raises(ValueError, match="cached with different weights"):
        eng.lora.register_task(7, w * 2, c)
    bad = c.copy()
    bad[0, 0, 0] = 9
    with pytest.raises(ValueError, match="module_id 9 is not supported"):
        eng.lora.register_task(9, w, bad)
