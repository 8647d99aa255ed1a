"""LoRA adapters on mixture-of-experts bases (Mixtral, Qwen3-MoE; backend/models/moe.py): adapters
on the attention projections match the oracle Hugging Face PEFT (float32 logits within 1e-4, the
same greedy tokens); adapters on the experts or the router, as PEFT 0.21 writes them
(`target_parameters`, `mlp.experts.*` tensors), are refused naming the adapter and the reason;
an adapter on a dense layer's MLP (Qwen3-MoE mlp_only_layers) matches transformers with the
delta merged into that layer's weights, and one on a sparse layer's MLP is refused."""
from __future__ import annotations

import json

import pytest
import torch

import test_models_moe  # noqa: F401 (registers the tiny MoE families with tiny_models)
from lora_utils import engine_logits, hf_greedy, make_peft_adapter, rel_err
from tritium.backend.engine import LLMEngine
from tritium.backend.lora.manager import LoRAConfig
from tritium.backend.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 17, 99, 3, 250, 31, 7, 8, 9, 10, 11], [400, 2, 77, 13, 13, 600, 42, 42, 42, 5, 1, 9]]
GREEDY = SamplingParams(max_tokens=10, temperature=0)
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]


def hf(ck):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(ck, dtype=torch.float32)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_attention_adapters_on_moe_match_peft(family, tiny_checkpoint, tiny_engine, tmp_path):
    ck = tiny_checkpoint(family)
    pm = make_peft_adapter(hf(ck), str(tmp_path / "attn"), seed=4, r=8, lora_alpha=16, target_modules=ATTN)
    eng = LLMEngine(tiny_engine(family, "float32"), device="cpu", num_kv_blocks=64,
                    lora=LoRAConfig({"attn": str(tmp_path / "attn")}))
    for ids in PROMPTS:
        with torch.no_grad():
            ref = pm(torch.tensor([ids])).logits[0]
            with pm.disable_adapter():
                base = pm(torch.tensor([ids])).logits[0]
        assert rel_err(base, ref) > 1e-2, "the adapter barely changes the model"
        assert rel_err(engine_logits(eng, ids, "attn"), ref) < 1e-4, family
    outs = eng.generate(prompt_token_ids=PROMPTS, params=GREEDY, lora_names=["attn", None])
    assert outs[0].outputs[0].token_ids == hf_greedy(pm, PROMPTS[0], GREEDY.max_tokens)
    with pm.disable_adapter():
        assert outs[1].outputs[0].token_ids == hf_greedy(pm, PROMPTS[1], GREEDY.max_tokens)


@pytest.mark.parametrize("family,kw", [
    ("mixtral", dict(target_modules="all-linear")),
    ("qwen3_moe", dict(target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"])),
    ("mixtral", dict(target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj"]))])
def test_expert_adapters_are_refused(family, kw, tiny_checkpoint, tiny_engine, tmp_path):
    """PEFT adapts the experts (and with all-linear the router) through target_parameters; the
    engine refuses the adapter by name, also when only its tensors say so."""
    make_peft_adapter(hf(tiny_checkpoint(family)), str(tmp_path), seed=5, r=4, lora_alpha=8, **kw)
    eng = LLMEngine(tiny_engine(family, "float32"), device="cpu", num_kv_blocks=64, lora=LoRAConfig({}))
    with pytest.raises(ValueError, match=r"LoRA adapter 'moe': .*adapters on experts (and routers )?are not supported"):
        eng.lora.add_adapter("moe", str(tmp_path))
    cfg_path = tmp_path / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["target_parameters"] = None
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"LoRA adapter 'moe': tensor .*adapts the (experts|router) of "
                                         r"mixture-of-experts layer \d+; adapters on experts"):
        eng.lora.add_adapter("moe", str(tmp_path))
    # a request naming a refused adapter fails alone; the engine keeps serving
    eng.lora.paths["moe"] = str(tmp_path)
    with pytest.raises(ValueError, match="LoRA adapter .moe."):
        eng.add_request("r1", prompt_token_ids=PROMPTS[0], params=GREEDY, lora_name="moe")
    assert eng.generate(prompt_token_ids=[PROMPTS[0]], params=GREEDY)[0].outputs[0].token_ids


def _save(path, tensors, targets):
    from safetensors.torch import save_file
    path.mkdir(exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                          "target_modules": targets}))


def test_dense_layer_mlp_adapter_on_qwen3_moe(tiny_checkpoint, tiny_engine, tmp_path):
    """Qwen3-MoE's layer 0 keeps a dense MLP (mlp_only_layers): an adapter on its gate/up/down
    equals transformers with W + (alpha / r) B A merged into those weights (PEFT 0.21 turns such
    targets into expert parameters, so it cannot write this adapter itself). The same parts on
    sparse layer 1 are refused."""
    ck = tiny_checkpoint("qwen3_moe")
    model = hf(ck)
    mlp = model.model.layers[0].mlp
    g = torch.Generator().manual_seed(6)
    tensors = {}
    for name in ("gate_proj", "up_proj", "down_proj"):
        lin = getattr(mlp, name)
        a = torch.randn(4, lin.in_features, generator=g) * 0.2
        b = torch.randn(lin.out_features, 4, generator=g) * 0.2
        tensors[f"base_model.model.model.layers.0.mlp.{name}.lora_A.weight"] = a
        tensors[f"base_model.model.model.layers.0.mlp.{name}.lora_B.weight"] = b
        with torch.no_grad():
            lin.weight += 2.0 * b @ a  # lora_alpha 8 / r 4
    _save(tmp_path / "dense", tensors, ["gate_proj", "up_proj", "down_proj"])
    eng = LLMEngine(tiny_engine("qwen3_moe", "float32"), device="cpu", num_kv_blocks=64,
                    lora=LoRAConfig({"dense": str(tmp_path / "dense")}))
    base = hf(ck)
    for ids in PROMPTS:
        with torch.no_grad():
            ref = model(torch.tensor([ids])).logits[0]
            plain = base(torch.tensor([ids])).logits[0]
        assert rel_err(plain, ref) > 1e-2
        assert rel_err(engine_logits(eng, ids, "dense"), ref) < 1e-4
    sparse = {k.replace("layers.0.", "layers.1."): v for k, v in tensors.items() if "gate_proj" in k}
    _save(tmp_path / "sparse", sparse, ["gate_proj"])
    with pytest.raises(ValueError, match=r"LoRA adapter 'sparse': has weights for layers\.1\.gate_proj, but layer 1 "
                                         r"is a mixture-of-experts layer"):
        eng.lora.add_adapter("sparse", str(tmp_path / "sparse"))
