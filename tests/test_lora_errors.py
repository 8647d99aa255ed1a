"""Bad LoRA input fails that request (or build) only, with an error naming the adapter and the
reason; never a silent fallback to the base model. Plus the CLI (`--lora NAME=PATH`) and the SmolLM2
check against PEFT on the real model."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from lora_utils import engine_logits, hf_greedy, make_peft_adapter, rel_err
from tritium.backend.engine import LLMEngine
from tritium.backend.lora.manager import LoRAConfig, parse_adapter_list
from tritium.backend.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0)
IDS = [5, 17, 99, 3, 250, 31, 7]


@pytest.fixture(scope="module")
def adapters(tiny_checkpoint, tmp_path_factory, one_thread):
    """name -> folder: a good llama adapter and broken ones."""
    from transformers import AutoModelForCausalLM
    root = tmp_path_factory.mktemp("lora-bad")
    out = {}

    def make(name, family="llama", **kw):
        base = AutoModelForCausalLM.from_pretrained(tiny_checkpoint(family), dtype=torch.float32)
        out[name] = str(root / name)
        return make_peft_adapter(base, out[name], **kw)
    out["_oracle"] = make("good", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    make("qwen", family="qwen2", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])  # another base
    make("big", r=32, lora_alpha=8, target_modules=["q_proj"])
    make("head", r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"])
    make("dora", r=4, lora_alpha=8, target_modules=["q_proj"], use_dora=True)
    os.makedirs(root / "pickled")
    with open(root / "pickled" / "adapter_model.bin", "wb") as f:
        f.write(b"not loaded")
    with open(root / "pickled" / "adapter_config.json", "w") as f:
        json.dump({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}, f)
    out["pickled"] = str(root / "pickled")
    out["missing"] = str(root / "does-not-exist")
    return out


@pytest.fixture(scope="module")
def engine(tiny_engine, adapters):
    paths = {k: v for k, v in adapters.items() if not k.startswith("_")}
    return LLMEngine(tiny_engine("llama"), device="cpu", lora=LoRAConfig(paths, max_lora_rank=16))


@pytest.mark.parametrize("name, reason", [
    ("nope", "unknown LoRA adapter 'nope'; this model serves: big, dora, good, head, missing, pickled, qwen$"),
    ("qwen", r"LoRA adapter 'qwen': layers.0.q_proj: lora_A \(4, 72\) / lora_B \(72, 4\) do not fit"),
    ("big", "LoRA adapter 'big': layers.0.q_proj has rank 32; this engine takes ranks 1..16"),
    ("head", "LoRA adapter 'head': target_modules .*lm_head.* cannot take LoRA"),
    ("dora", "LoRA adapter 'dora': DoRA"),
    ("pickled", "LoRA adapter 'pickled': .* holds only adapter_model.bin, a pickle; Tritium never unpickles"),
    ("missing", "LoRA adapter 'missing': .*does-not-exist is not a folder"),
])
def test_bad_adapter_fails_only_that_request(engine, adapters, name, reason):
    free = engine.block_manager.num_free_blocks
    with pytest.raises(ValueError, match=reason) as err:
        engine.add_request(f"bad-{name}", prompt_token_ids=IDS, params=GREEDY, lora_name=name)
    if name == "nope":  # the error contract: a bad_parameter naming the request field
        assert (err.value.code, err.value.field) == ("bad_parameter", "lora_name")
    assert not engine.requests and engine.block_manager.num_free_blocks == free
    out = engine.generate(prompt_token_ids=[IDS], params=GREEDY, lora_names="good")[0]  # still serving
    assert out.outputs[0].token_ids == hf_greedy(adapters["_oracle"], IDS, 8)


def test_adapter_named_by_the_request_field(engine, adapters):
    """SamplingParams.lora_name (the schema field every surface fills) picks the adapter too."""
    import dataclasses
    out = engine.generate(prompt_token_ids=[IDS], params=dataclasses.replace(GREEDY, lora_name="good"))[0]
    assert out.outputs[0].token_ids == hf_greedy(adapters["_oracle"], IDS, 8)


def test_engine_without_lora_refuses_an_adapter(tiny_engine):
    eng = LLMEngine(tiny_engine("llama"), device="cpu")
    with pytest.raises(ValueError, match="lora_name 'good': this engine serves no LoRA adapters"):
        eng.add_request("x", prompt_token_ids=IDS, params=GREEDY, lora_name="good")


def test_adapter_added_at_run_time(engine, adapters):
    """No rebuild: register a new adapter on a running engine."""
    engine.lora.add_adapter("good2", adapters["good"])
    out = engine.generate(prompt_token_ids=[IDS], params=GREEDY, lora_names="good2")[0]
    assert out.outputs[0].token_ids == hf_greedy(adapters["_oracle"], IDS, 8)
    with pytest.raises(ValueError, match="adapter names are letters"):
        engine.lora.add_adapter("bad name", adapters["good"])


def test_host_cache_is_lru_bounded(tiny_engine, adapters):
    eng = LLMEngine(tiny_engine("llama"), device="cpu",
                    lora=LoRAConfig({"a": adapters["good"], "b": adapters["good"], "c": adapters["good"]},
                                    max_loras=1, max_cpu_loras=2))
    for n in ("a", "b", "c", "a"):
        eng.lora.resolve(n)
    assert eng.lora.cached_keys() == ["c", "a"]


def test_adapter_list_parsing():
    assert parse_adapter_list("sql=/a/b, chat=~/c") == {"sql": "/a/b", "chat": "~/c"}
    for bad, msg in (("sql", "NAME=PATH"), ("a=/x,a=/y", "listed twice"), ("a b=/x", "letters")):
        with pytest.raises(ValueError, match=msg):
            parse_adapter_list(bad)
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LoRAConfig({}, max_loras=4, max_cpu_loras=2).validate()


def test_cli_build_repo_and_generate_with_lora(tiny_engine, adapters, tmp_path):
    """`tritium build --repo --lora` writes lora_adapters; `tritium generate --lora` serves it;
    a missing adapter fails the build before it starts."""
    cli = [sys.executable, "-m", "tritium.client.cli"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(cli + ["generate", "--engine", tiny_engine("llama"), "--prompt-ids", ",".join(map(str, IDS)),
                              "--max-tokens", "8", "--json", "--lora", f"good={adapters['good']}",
                              "--lora-name", "good", "--device", "cpu"], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["token_ids"] == hf_greedy(adapters["_oracle"], IDS, 8)
    from tritium.builder.repository import write_repository
    write_repository(str(tmp_path / "repo"), "tiny", tiny_engine("llama"), engine_params={
        "lora_adapters": f"good={adapters['good']}"})
    text = (tmp_path / "repo" / "tiny" / "config.pbtxt").read_text()
    assert f'key: "lora_adapters" value {{ string_value: "good={adapters["good"]}" }}' in text
    r = subprocess.run(cli + ["build", "nowhere", "-o", str(tmp_path / "e"), "--repo", str(tmp_path / "r2"),
                              "--lora", f"bad={adapters['missing']}"], capture_output=True, text=True, env=env)
    assert r.returncode != 0 and "LoRA adapter 'bad'" in r.stderr and "is not a folder" in r.stderr
    assert not (tmp_path / "e").exists()


@pytest.mark.slow
def test_smollm2_random_adapter_matches_peft(smollm2_engine, smollm2_gguf, tmp_path, one_thread):
    """SmolLM2-135M (through transformers' GGUF loader) with a random adapter: PEFT's fp32
    logits and greedy tokens."""
    import warnings

    from transformers import AutoModelForCausalLM
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = AutoModelForCausalLM.from_pretrained(os.path.dirname(smollm2_gguf), gguf_file=os.path.basename(smollm2_gguf),
                                                    dtype=torch.float32).eval()
    pm = make_peft_adapter(base, str(tmp_path / "ad"), std=0.05, r=8, lora_alpha=16,
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    eng = LLMEngine(smollm2_engine("float32"), device="cpu", num_kv_blocks=64,
                    lora=LoRAConfig({"rand": str(tmp_path / "ad")}))
    ids = eng.tokenizer.encode("The capital of France is").ids
    with torch.no_grad():
        ref = pm(torch.tensor([ids])).logits[0]
        with pm.disable_adapter():
            base_logits = pm(torch.tensor([ids])).logits[0]
    assert rel_err(base_logits, ref) > 1e-2
    assert rel_err(engine_logits(eng, ids, "rand"), ref) < 1e-4
    out = eng.generate(prompt_token_ids=[ids], params=SamplingParams(max_tokens=16, temperature=0), lora_names="rand")
    assert out[0].outputs[0].token_ids == hf_greedy(pm, ids, 16)


def test_contract_parsing_of_lora_fields():
    """The tensor contract's LoRA fields, parsed per row with errors naming the field."""
    import numpy as np

    from tritium.backend.triton_backend.request import parse_row
    from tritium.client.serve.generate_checks import check_generate_fields
    from tritium.client.serve.http_checks import GuardError
    text = np.array([[b"hi"]], dtype=object)
    p = parse_row({"text_input": text, "sampling_parameters": np.array([[b'{"lora_name": "sql", "top_k": 3}']],
                                                                       dtype=object)}, 0, 1)
    assert p.lora_name == p.sampling.lora_name == "sql" and p.sampling.top_k == 3  # a request field
    w, c = np.zeros((1, 2, 10), np.float16), np.zeros((1, 2, 3), np.int32)
    p = parse_row({"text_input": text, "lora_task_id": np.array([[7]], np.uint64), "lora_weights": w,
                   "lora_config": c}, 0, 1)
    assert p.lora_task_id == 7 and p.lora_tensors[0].shape == (2, 10)
    from tritium.backend.errors import RequestError
    for arrays, msg, field in (
            ({"lora_weights": w, "lora_config": c}, "need lora_task_id", "lora_task_id"),
            ({"lora_task_id": np.array([[7]], np.uint64), "lora_weights": w}, "come together", "lora_config"),
            ({"lora_task_id": np.array([[7]], np.uint64),
              "sampling_parameters": np.array([[b'{"lora_name": "a"}']], dtype=object)}, "one of", "lora_name"),
            ({"sampling_parameters": np.array([[b'{"lora_name": 5}']], dtype=object)},
             "lora_name must be a string, got 5", "lora_name"),
            ({"lora_task_id": np.array([[-1]], np.int64)}, r"lora_task_id must be in \[0, ", "lora_task_id")):
        with pytest.raises(RequestError, match=msg) as err:
            parse_row(dict(arrays, text_input=text), 0, 1)
        assert err.value.code == "bad_parameter" and err.value.field == field, (msg, err.value.field)
    with pytest.raises(GuardError, match="lora_config is a 2-D tensor"):
        check_generate_fields({"text_input": "x", "lora_config": [[1, 0, 4]]})


def test_lora_options_come_from_the_engine_options_table(tmp_path):
    """config.pbtxt parameters -> LoRAConfig through backend/engine_options.py (paths relative to the
    model folder; bad values name the parameter)."""
    from tritium.backend.engine_options import engine_setup, options_from_params
    setup = engine_setup(options_from_params({"lora_adapters": "sql=ad/sql,chat=/abs/chat", "max_loras": "2",
                                              "max_lora_rank": "8"}), base_dir=str(tmp_path))
    cfg = setup.engine_kwargs["lora"]
    assert cfg.adapters == {"sql": str(tmp_path / "ad" / "sql"), "chat": "/abs/chat"}
    assert (cfg.max_loras, cfg.max_lora_rank) == (2, 8)
    assert "lora" not in engine_setup(options_from_params({"max_loras": "2"})).engine_kwargs  # no adapters: off
    assert engine_setup(options_from_params({"enable_lora": "true"})).engine_kwargs["lora"].adapters == {}
    for params, needle in (({"max_loras": "0"}, "parameter max_loras must be an integer in [1, inf]"),
                           ({"enable_lora": "yes"}, "parameter enable_lora must be true or false"),
                           ({"lora_adapters": "a=x,a=y"}, "adapter 'a' is listed twice")):
        with pytest.raises(ValueError, match=re.escape(needle)):
            engine_setup(options_from_params(params))


def test_lora_flags_are_declared_once_for_build_and_generate(tmp_path):
    """`tritium build --repo` and `tritium generate --engine` take --lora NAME=PATH and the LoRA limits
    from backend/engine_options.py: the same help and value name in both, limits checked by the table's
    range (the error names the flag), and the flags turn into the lora_adapters option."""
    from tritium.backend.engine_options import OPTION
    from tritium.backend.errors import RequestError
    from tritium.builder.lora_repo import lora_params
    from tritium.client.cli.engine_generate import lora_options
    from tritium.client.cli.main import build_parser
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices
    flags = {cmd: {o: a for a in sub[cmd]._actions for o in a.option_strings} for cmd in ("build", "generate")}
    for flag in ("--lora", "--max-lora-rank"):
        b, g = flags["build"][flag], flags["generate"][flag]
        assert (b.help, b.metavar, b.default, b.dest) == (g.help, g.metavar, g.default, g.dest), flag
    assert flags["build"]["--max-lora-rank"].help == OPTION["max_lora_rank"].help
    assert flags["build"]["--max-loras"].help == OPTION["max_loras"].help
    (tmp_path / "a").mkdir()
    build = sub["build"].parse_args(["ck", "-o", "e", "--repo", "r", "--lora", f"a={tmp_path / 'a'}",
                                     "--max-loras", "0"])
    with pytest.raises(ValueError, match=re.escape("--max-loras must be an integer in [1, inf], got 0")):
        lora_params(build)
    gen = sub["generate"].parse_args(["--engine", "e", "x", "--lora", f"a={tmp_path / 'a'}", "--lora", "b=/b",
                                      "--lora-name", "b", "--max-lora-rank", "8"])
    cfg, name = lora_options(gen)
    assert (cfg.adapters, cfg.max_lora_rank, name) == ({"a": str(tmp_path / "a"), "b": "/b"}, 8, "b")
    for args, needle in ((["--lora", "a=/x", "--lora", "a=/y"], "--lora: adapter 'a' is given twice"),
                         (["--lora", "a=/x,y"], "must not contain ','"),
                         (["--lora", "a=/x", "--max-lora-rank", "0"],
                          "--max-lora-rank must be an integer in [1, inf]")):
        with pytest.raises(ValueError, match=re.escape(needle)):
            lora_options(sub["generate"].parse_args(["--engine", "e", "x", *args]))
    with pytest.raises(RequestError) as e:  # an adapter it does not serve: as the engine answers it
        lora_options(sub["generate"].parse_args(["--engine", "e", "x", "--lora", "a=/x", "--lora-name", "nope"]))
    assert (e.value.code, e.value.field) == ("bad_parameter", "lora_name")
