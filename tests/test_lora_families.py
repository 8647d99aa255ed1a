"""LoRA adapters on the other dense families against the oracle Hugging Face PEFT (PeftModel on
the same tiny random base, float32): Qwen3 (per-head q/k norms), Gemma 2 / Gemma 3 text (soft-caps,
sandwich norms, sliding windows), Phi-3 (the checkpoint's own fused qkv_proj / gate_up_proj,
which PEFT targets by those names), OLMo 2 (q/k norms over the whole projection) and Granite
(multipliers, biases). Logits within 1e-4 and the same greedy tokens."""
from __future__ import annotations

import pytest
import torch

from lora_utils import engine_logits, hf_greedy, make_peft_adapter, rel_err
from tritium.backend.engine import LLMEngine
from tritium.backend.lora.manager import LoRAConfig
from tritium.backend.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

SPLIT = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# family -> (PEFT LoraConfig arguments, build options)
CASES = {
    "qwen3": (dict(r=8, lora_alpha=16, target_modules=SPLIT), {}),
    "gemma2": (dict(r=6, lora_alpha=12, target_modules="all-linear", use_rslora=True), {}),
    "gemma3": (dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]), {}),
    # Phi-3 fuses q/k/v and gate/up in its checkpoint; short LongRoPE factors up to 48 tokens as HF
    "phi3": (dict(r=8, lora_alpha=16, target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
             {"max_seq_len": 48}),
    "olmo2": (dict(r=8, lora_alpha=8, target_modules=["q_proj", "k_proj", "up_proj"],
                   rank_pattern={"k_proj": 3}), {}),
    "granite": (dict(r=5, lora_alpha=10, target_modules="all-linear"), {}),
}
PROMPTS = [[5, 17, 99, 3, 250, 31, 7, 8, 9, 10, 11], [400, 2, 77, 13, 13, 600, 42, 42, 42, 5, 1, 9, 300, 21]]
GREEDY = SamplingParams(max_tokens=10, temperature=0)


@pytest.mark.parametrize("family", list(CASES))
def test_family_adapter_matches_peft(family, tiny_checkpoint, tiny_engine, tmp_path):
    from transformers import AutoModelForCausalLM
    kw, build = CASES[family]
    ck = tiny_checkpoint(family)
    pm = make_peft_adapter(AutoModelForCausalLM.from_pretrained(ck, dtype=torch.float32), str(tmp_path), seed=3, **kw)
    eng = LLMEngine(tiny_engine(family, "float32", **build), device="cpu", lora=LoRAConfig({"a": str(tmp_path)}))
    for ids in PROMPTS:
        with torch.no_grad():
            ref = pm(torch.tensor([ids])).logits[0]
            with pm.disable_adapter():
                base = pm(torch.tensor([ids])).logits[0]
        assert rel_err(base, ref) > 1e-2, "the adapter barely changes the model; the test would not see it"
        assert rel_err(engine_logits(eng, ids, "a"), ref) < 1e-4, family
        out = eng.generate(prompt_token_ids=[ids], params=GREEDY, lora_names="a")[0].outputs[0].token_ids
        assert out == hf_greedy(pm, ids, GREEDY.max_tokens), family


def test_fused_and_split_weights_for_one_linear_are_refused(tiny_engine, tmp_path):
    """An adapter with both qkv_proj and q_proj weights in one layer is ambiguous: refused by name."""
    import json
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(0)
    pre = "base_model.model.model.layers.0.self_attn"
    q_out, qkv_out = 6 * 16, (6 + 2 * 3) * 16  # tiny llama: 6 / 3 heads of 16, hidden 72
    save_file({f"{pre}.qkv_proj.lora_A.weight": torch.randn(4, 72, generator=g),
               f"{pre}.qkv_proj.lora_B.weight": torch.randn(qkv_out, 4, generator=g),
               f"{pre}.q_proj.lora_A.weight": torch.randn(4, 72, generator=g),
               f"{pre}.q_proj.lora_B.weight": torch.randn(q_out, 4, generator=g)},
              str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["qkv_proj", "q_proj"]}))
    eng = LLMEngine(tiny_engine("llama", "float32"), device="cpu", lora=LoRAConfig({}))
    with pytest.raises(ValueError, match=r"'both'.*qkv_proj and for its parts \['q_proj'\]"):
        eng.lora.add_adapter("both", str(tmp_path))
