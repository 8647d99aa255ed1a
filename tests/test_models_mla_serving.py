"""DeepSeek-V3 and DeepSeek-V2 (multi-head latent attention, DeepSeek routing) beyond one engine
on one rank: TP = 2 == TP = 1, int8 / int4 (RTN) experts against their dequantized weights,
configs the engine cannot honour refused naming the field (in the builder, the CLI and at load),
and a V3 engine served through a real tritonserver. Numerics against HF, the latent cache and
batching: tests/test_models_mla.py."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from deepseek_models import V2, V3, ds_checkpoint, ds_engine  # noqa: F401 (fixtures)
from hf_oracle import PROMPTS, rel_err
from simple_generate import prompt_logits
from tp_utils import assert_tp2_equals_tp1, tp_timeout  # noqa: F401 (fixture)
from tritium.backend.engine import LLMEngine
from tritium.backend.loader import load_engine
from tritium.backend.sampling_params import SamplingParams
from tritium.builder.convert import CheckpointError
from tritium.builder.hf_loader import model_config_from_hf

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.usefixtures("tp_timeout")
def test_tp2_heads_and_experts_split_equals_tp1(ds_engine):
    """TP = 2 (MLA heads split by head: q / q_b_proj rows, kv_b_proj rows, o_proj columns; the
    latent replicated; experts and shared experts split by columns; routers replicated) == TP = 1,
    for DeepSeek-V3 (q_b_proj; V2-Lite's q_proj takes the same row split)."""
    from safetensors import safe_open

    def shapes(path):
        with safe_open(f"{path}/rank1.safetensors", "pt") as f:
            assert tuple(f.get_tensor("layers.1.kv_b_proj.weight").shape) == (2 * (16 + 32), 40)
            assert tuple(f.get_tensor("layers.1.o_proj.weight").shape) == (64, 2 * 32)
            assert tuple(f.get_tensor("layers.1.kv_a_proj.weight").shape) == (48, 64)

    assert_tp2_equals_tp1(lambda **kw: ds_engine("deepseek_v3", "float32", **kw), shapes)


@pytest.mark.parametrize("method", ["int8", "int4-rtn", "int4-gptq", "fp8"])
def test_quantized_experts_serve_their_dequantized_weights(method, ds_engine):
    """A V3 engine with int8 / int4 (RTN, or GPTQ per expert on the tokens its sigmoid,
    group-limited router sends it) / fp8 experts (and o_proj / dense MLP quantized; the MLA
    projections float): the logits equal those of the engine holding the dequantized experts."""
    import dataclasses
    from test_models_moe import _dequantized
    from tritium.backend.models.decoder import DecoderLM
    path = ds_engine("deepseek_v3", quantization=method, eval_tokens=0, calibration_samples=4)
    cfg, model, _ = load_engine(path, "cpu")
    tensors = load_file(f"{path}/rank0.safetensors")
    kind = method.split("-")[0]
    assert cfg.quantization.layers["layers.1.experts.gate_up"].method == kind
    assert "layers.1.experts.down_weight" not in tensors and "layers.0.gate_up_proj.qweight" in tensors
    assert "layers.1.kv_b_proj.weight" in tensors and "layers.1.qkv_proj" not in cfg.quantization.layers
    deq = _dequantized(cfg, tensors)
    layers = {k: v for k, v in cfg.quantization.layers.items() if ".experts." not in k}
    ref_model = DecoderLM(dataclasses.replace(cfg, quantization=dataclasses.replace(cfg.quantization, layers=layers)))
    ref_model.load_engine_weights({**{k: v for k, v in tensors.items() if ".experts." not in k},
                                   **{k: v for k, v in deq.items() if ".experts." in k}})
    # the dense linears' activations as the engine's (int8 / int4 builds: W8A8 / W4A8 by default)
    from tritium.backend.quant import set_activation_quant
    set_activation_quant(ref_model, cfg.activation_quant)
    for ids in PROMPTS[:2]:
        got, ref = prompt_logits(model, ids), prompt_logits(ref_model.eval(), ids)
        assert rel_err(got, ref) < 1e-5, (method, rel_err(got, ref))


CLI = [sys.executable, "-m", "tritium.client.cli"]
BAD = {"v3 scoring_func": (V3, dict(scoring_func="softmax"), ["scoring_func", "'softmax'", "sigmoid"]),
       "v3 topk_method": (V3, dict(topk_method="greedy"), ["topk_method", "'greedy'", "noaux_tc"]),
       "v2 topk_method": (V2, dict(topk_method="noaux_tc"), ["topk_method", "'noaux_tc'", "group_limited_greedy"]),
       "v2 norm_topk_prob": (V2, dict(norm_topk_prob=True), ["norm_topk_prob"]),
       "n_group": (V3, dict(n_group=3), ["n_group 3"]),
       "attention_bias": (V3, dict(attention_bias=True), ["attention_bias"]),
       "rope_interleave": (V3, dict(rope_interleave=False), ["rope_interleave", "False"])}


@pytest.mark.parametrize("case", list(BAD))
def test_unhonourable_config_is_refused_naming_it(case):
    base, edit, needles = BAD[case]
    with pytest.raises(CheckpointError) as e:
        model_config_from_hf(dict(base, **edit))
    assert all(n in str(e.value) for n in needles), str(e.value)


def test_cli_build_refusal_is_one_line_exit_2(ds_checkpoint, tmp_path):
    src = ds_checkpoint("deepseek_v3")
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    cfg = json.load(open(f"{src}/config.json"))
    (dst / "config.json").write_text(json.dumps(dict(cfg, topk_method="greedy")))
    r = subprocess.run(CLI + ["build", str(dst), "-o", str(tmp_path / "e")], capture_output=True, text=True)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "topk_method 'greedy'" in r.stderr and not (tmp_path / "e" / "engine.json").exists(), r.stderr


def test_quantized_kv_cache_refused_before_any_work(ds_checkpoint, tmp_path):
    from tritium.builder.build import BuildOptions, build_engine
    with pytest.raises(ValueError, match="--kv-cache-dtype int8: the latent cache"):
        build_engine(BuildOptions(source=ds_checkpoint("deepseek_v3"), output=str(tmp_path / "e"),
                                  kv_cache_dtype="int8", progress=False))
    assert not (tmp_path / "e").exists()


@pytest.mark.parametrize("field,value,needle", [("router_topk", "top2", "model.router_topk 'top2'"),
                                                ("n_group", 3, "model.n_group 3"),
                                                ("head_dim", 20, "head_dim 20"),
                                                ("v_head_dim", 0, "model.v_head_dim"),
                                                ("kv_lora_rank", -8, "model.kv_lora_rank must be an integer >= 0")])
def test_engine_json_mla_fields_checked_at_load(field, value, needle, ds_engine):
    from tritium.backend.config import EngineConfig, EngineFormatError
    d = json.load(open(f"{ds_engine('deepseek_v3')}/engine.json"))
    d["model"][field] = value
    with pytest.raises(EngineFormatError) as e:
        EngineConfig.from_dict(d)
    assert needle in str(e.value), str(e.value)


def test_deepseek_v3_serves_through_tritonserver(ds_engine, tmp_path):
    """A DeepSeek-V3 engine behind the real tritonserver: greedy tokens over gRPC equal the
    in-process engine's, for a prompt and then a second one sharing its prefix (latent blocks reused)."""
    from tritium.builder.repository import write_repository
    from tritium.client.serve.server import TritonServer, prepare_backend_dir
    from tritium.client.triton_client import TritiumClient
    path = ds_engine("deepseek_v3")
    repo = str(tmp_path / "repo")
    write_repository(repo, "ds", path, engine_params={"num_kv_blocks": "64", "num_threads": "1",
                                                     "small_step_threads": "1"})
    srv = TritonServer(repo, log_file=str(tmp_path / "server.log"), load_models=["ds"],
                       backend_dir=prepare_backend_dir(str(tmp_path / "backends")))
    srv.start(timeout=300)
    try:
        client = TritiumClient(srv.grpc_url, protocol="grpc", model="ds", timeout=120)
        ref_engine = LLMEngine(path, device="cpu", num_kv_blocks=64)
        for text in ("Latent attention caches one row", "Latent attention caches one row per token"):
            ref = ref_engine.generate([text], SamplingParams(max_tokens=8, min_tokens=8, temperature=0.0))[0]
            got = client.generate(text, max_tokens=8, min_tokens=8, temperature=0.0)
            assert got.token_ids == ref.outputs[0].token_ids, text
    finally:
        srv.stop()
