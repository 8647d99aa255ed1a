"""`--quantization auto --max-ppl-increase`: the allocation (against brute force), mixed engines
(runtime == dequantized weights, HF closeness, the engine and tensor parallelism), the budget
(generous -> all int4, zero -> met with the sensitive layers kept precise, unreachable -> exit
status 3), the report, and bad flags."""
from __future__ import annotations

import itertools
import json
import os
import random

import pytest
import torch

from tritium.backend.config import EngineConfig, LayerQuant
from tritium.backend.engine import LLMEngine
from tritium.backend.loader import load_engine
from tritium.backend.sampling_params import SamplingParams
from tritium.builder.build import BuildOptions, build_engine
from tritium.builder.quant.quant_auto_alloc import Option, allocation_ladder, lower_hull, total_bytes, total_sensitivity
from tritium.client.cli.main import main as cli_main

from test_quant_pipeline import PROMPT, _dequantized_model, _kl, _logits
from tp_utils import record_logits, tp_timeout  # noqa: F401 (fixture)

# hidden 128 / intermediate 192: int4 groups of 128 fit the q/k/v, o and gate/up inputs, not down's
DIMS = dict(hidden_size=128, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
FAST = dict(dtype="float32", progress=False, calibration_samples=8, eval_tokens=512)
LINEAR_NAMES = [f"layers.{i}.{lin}" for i in range(3)
                for lin in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")]


def _report(engine_dir):
    with open(os.path.join(engine_dir, "build_report.json")) as f:
        return json.load(f)["quantization_report"]


# ---- allocation (pure) -------------------------------------------------------------------

def test_lower_hull_drops_dominated_and_non_convex_options():
    opts = [Option("a", 10, 1.0), Option("b", 20, 0.5), Option("c", 25, 0.9),  # c: dominated by b
            Option("d", 30, 0.45), Option("e", 40, 0.0)]  # d: above the segment b -> e
    assert [o.name for o in lower_hull(opts)] == ["a", "b", "e"]


def test_ladder_rungs_are_optimal_for_their_bytes_against_brute_force():
    rng = random.Random(0)
    options = {}
    for n in range(5):
        sizes = sorted(rng.sample(range(1, 60), 4))
        sens = sorted((rng.random() for _ in sizes), reverse=True)
        options[f"l{n}"] = [Option(f"c{k}", b, s if k < 3 else 0.0) for k, (b, s) in enumerate(zip(sizes, sens))]
    ladder = allocation_ladder(options)
    everything = [dict(zip(options, combo)) for combo in itertools.product(*options.values())]
    assert total_bytes(ladder[0]) == min(map(total_bytes, everything))
    assert total_sensitivity(ladder[-1]) == 0.0
    for a, b in zip(ladder, ladder[1:]):
        assert total_bytes(b) > total_bytes(a) and total_sensitivity(b) < total_sensitivity(a)
    for rung in ladder:  # no assignment of at most its bytes is less sensitive
        best = min(total_sensitivity(x) for x in everything if total_bytes(x) <= total_bytes(rung))
        assert total_sensitivity(rung) <= best + 1e-12


# ---- flags ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kw,needle", [
    (dict(quantization="auto"), "--quantization auto needs a quality budget: --max-ppl-increase"),
    (dict(quantization="int8", max_ppl_increase=0.5), "--max-ppl-increase applies only to --quantization auto"),
    (dict(quantization="none", auto_candidates="int8"), "--auto-candidates applies only to --quantization auto"),
    (dict(quantization="auto", max_ppl_increase=-1.0), "--max-ppl-increase must be a finite number of percent >= 0"),
    (dict(quantization="auto", max_ppl_increase=float("nan")), "--max-ppl-increase must be a finite number"),
    (dict(quantization="auto", max_ppl_increase=0.5, auto_int4_method="int4-foo"),
     "--auto-int4-method 'int4-foo' not supported; allowed: int4-rtn, int4-awq, int4-gptq"),
    (dict(quantization="auto", max_ppl_increase=0.5, auto_candidates="int4,int3"),
     "--auto-candidates 'int4,int3': expected a comma-separated list of int4, int8, none"),
    (dict(quantization="auto", max_ppl_increase=0.5, auto_candidates=" , "), "--auto-candidates"),
])
def test_bad_flags_are_refused_before_any_work(tiny_checkpoint, tmp_path, kw, needle):
    out = tmp_path / "engine"
    with pytest.raises(ValueError) as e:
        build_engine(BuildOptions(source=tiny_checkpoint("llama", **DIMS), output=str(out), **kw))
    assert needle in str(e.value)
    assert not out.exists()


def test_cli_flag_errors_are_one_line(tiny_checkpoint, tmp_path, capsys):
    rc = cli_main(["build", tiny_checkpoint("llama", **DIMS), "-o", str(tmp_path / "e"),
                   "--quantization", "auto", "--max-ppl-increase", "-0.5", "--quiet"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "--max-ppl-increase must be" in err


# ---- mixed engines -----------------------------------------------------------------------

def _build_with_plan(ckpt, plan, out) -> str:
    """A float32 engine of `ckpt` quantized by the pipeline with a given per-layer plan (the
    int4 layers by RTN), written to folder `out`."""
    import dataclasses

    from safetensors.torch import load_file, save_file

    from tritium.builder.quant.quant_pipeline import quantize_engine_weights
    fdir = str(out) + "-float"
    if not os.path.isdir(fdir):
        build_engine(BuildOptions(source=ckpt, output=fdir, dtype="float32", progress=False))
    cfg = EngineConfig.load(fdir)
    tensors = load_file(os.path.join(fdir, "rank0.safetensors"))
    new, qcfg, kvcfg, _ = quantize_engine_weights(cfg, tensors, quantization="int4-rtn", layer_plan=plan,
                                                  progress=False, eval_tokens=0, source=ckpt)
    os.makedirs(out)
    dataclasses.replace(cfg, quantization=qcfg, kv_cache=kvcfg).save(str(out))
    save_file(new, os.path.join(out, "rank0.safetensors"))
    for f in os.listdir(fdir):
        if not f.startswith(("rank", "engine.json", "build_report")):
            with open(os.path.join(fdir, f), "rb") as a, open(os.path.join(out, f), "wb") as b:
                b.write(a.read())
    return str(out)


def test_mixed_engine_runs_each_linear_in_its_own_format(tiny_checkpoint, tmp_path):
    """A hand-made plan (float / int8 / int4 with three group sizes) through the pipeline: the
    runtime builds each linear from its own entry, equals the dequantized-weights model and stays
    close to HF's float model."""
    from transformers import AutoModelForCausalLM

    ckpt = tiny_checkpoint("llama", **DIMS)
    plan = {"layers.0.qkv_proj": LayerQuant("none"), "layers.0.o_proj": LayerQuant("int8"),
            "layers.0.gate_up_proj": LayerQuant("int4", group_size=128),
            "layers.0.down_proj": LayerQuant("int4", group_size=64),
            "layers.1.qkv_proj": LayerQuant("int4", group_size=64), "layers.1.o_proj": LayerQuant("none"),
            "layers.1.gate_up_proj": LayerQuant("int8"), "layers.1.down_proj": LayerQuant("int4", group_size=32),
            "layers.2.qkv_proj": LayerQuant("int8"), "layers.2.o_proj": LayerQuant("int4", group_size=32),
            "layers.2.gate_up_proj": LayerQuant("none"), "layers.2.down_proj": LayerQuant("int8"),
            "embed_tokens": LayerQuant("none"), "lm_head": LayerQuant("int8")}
    qdir = _build_with_plan(ckpt, plan, tmp_path / "mixed")
    qcfg2, qmodel, _ = load_engine(qdir, "cpu")
    for name, lq in plan.items():
        assert qcfg2.quantization.layers[name] == lq
    i, lin = 0, "down_proj"
    assert type(getattr(qmodel.layers[i], lin)).__name__ == "Int4Linear"
    assert getattr(qmodel.layers[i], lin).group_size == 64
    assert type(qmodel.layers[0].o_proj).__name__ == "Int8Linear"
    assert type(qmodel.layers[0].qkv_proj).__name__ == "DenseLinear"
    assert type(qmodel.lm_head).__name__ == "Int8Linear" and qmodel.embed_tokens is None
    ql = _logits(qmodel, PROMPT)
    assert _kl(_logits(_dequantized_model(qdir), PROMPT), ql) < 2e-3
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0]
    assert _kl(ref, ql) < 0.5  # int4's bound on this random model (test_quant_pipeline)


# ---- budgets -------------------------------------------------------------------------------

def test_generous_budget_takes_int4_everywhere_and_reports_every_linear(tiny_checkpoint, tmp_path):
    out = str(tmp_path / "auto")
    cfg = build_engine(BuildOptions(source=tiny_checkpoint("llama", **DIMS), output=out,
                                    quantization="auto", max_ppl_increase=1000.0, **FAST))
    layers = cfg.quantization.layers
    assert cfg.quantization.method == "auto" and cfg.quantization.budget["met"]
    # --activation-quant auto (the default) stays weight-only here: the budget is measured weight-only
    assert cfg.activation_quant == "none" and not cfg.quantization.smoothquant
    for name in LINEAR_NAMES:
        assert layers[name].method == "int4", name
    # the cheapest int4 for each linear: the largest group size that divides its input
    assert layers["layers.0.gate_up_proj"].group_size == 128
    assert layers["layers.0.down_proj"].group_size == 64
    assert layers["layers.0.o_proj"].group_size == 128
    assert layers["embed_tokens"].method == "int8" and layers["lm_head"].method == "int8"
    auto = _report(out)["auto"]
    assert set(auto["layers"]) == set(LINEAR_NAMES) | {"embed_tokens", "lm_head"}
    for name, entry in auto["layers"].items():
        assert entry["choice"] in entry["options"] and "none" in entry["options"]
    assert auto["measured_ppl_increase_pct"] == pytest.approx(100 * _report(out)["eval"]["budget_check"]["perplexity_increase"])
    # the budget is checked on the worst of the budget mix's four texts, accepted at 0.75 of the budget
    check = auto["budget_check"]
    assert set(check["domains"]) == {"docstrings", "prose", "dialogue", "code"}
    assert check["worst_ppl_increase_pct"] == pytest.approx(max(check["domains"].values()), abs=1e-3)
    assert check["worst_domain"] == max(check["domains"], key=check["domains"].get)
    assert check["accept_below_pct"] == pytest.approx(750.0) and all(n > 0 for n in check["tokens_per_domain"])
    # the engine serves: greedy decoding through the engine
    with LLMEngine(out, device="cpu", num_kv_blocks=64) as eng:
        outs = eng.generate(prompt_token_ids=[PROMPT], params=SamplingParams(max_tokens=8, temperature=0.0,
                                                                                ignore_eos=True))
    assert len(outs[0].outputs[0].token_ids) == 8


@pytest.fixture()
def model_sampled_eval_text(tiny_checkpoint, monkeypatch):
    """The held-out slice's tokens sampled from the float model itself (not text: re-tokenizing
    decoded text changes the ids), so that any rounding raises the expected NLL by its KL; on
    arbitrary text a random model's perplexity moves either way."""
    from transformers import AutoModelForCausalLM

    from tritium.builder import heldout_eval
    from tritium.builder.quant import quant_auto_budget
    ckpt = tiny_checkpoint("llama", **DIMS)
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        rows = hf.generate(torch.randint(5, 900, (4, 1)), do_sample=True, temperature=1.0, top_k=0,
                           max_new_tokens=127, min_new_tokens=127, pad_token_id=0)
    ids = rows.flatten().tolist()

    def encode_text(tokenizer, text, num_tokens, *a, **kw):
        return ids[:num_tokens] if num_tokens else ids
    for mod in (quant_auto_budget, heldout_eval):
        monkeypatch.setattr(mod, "encode_text", encode_text)
    return ckpt


def test_zero_budget_keeps_the_sensitive_layers_precise_and_is_met(model_sampled_eval_text, tmp_path):
    out = str(tmp_path / "auto0")
    cfg = build_engine(BuildOptions(source=model_sampled_eval_text, output=out, quantization="auto",
                                    max_ppl_increase=0.0, **FAST))
    auto = _report(out)["auto"]
    assert auto["met"] and auto["measured_ppl_increase_pct"] <= 0.0
    layers = cfg.quantization.layers
    # the linear whose int4 costs the most KL cannot be int4 under a zero budget
    worst = max(LINEAR_NAMES, key=lambda n: max(o["sensitivity_kl"] for c, o in auto["layers"][n]["options"].items()
                                                if c.startswith("int4")))
    assert layers[worst].method != "int4"
    assert any(layers[n].method in ("none", "int8") for n in LINEAR_NAMES)
    # fewer bytes than float is only allowed where the measurement says it costs nothing
    assert all(r["met"] == (r["ppl_increase_pct"] <= 0.0) for r in auto["search"])


def test_unreachable_budget_writes_the_engine_and_exits_3(model_sampled_eval_text, tmp_path, capsys):
    out = str(tmp_path / "int4only")
    rc = cli_main(["build", model_sampled_eval_text, "-o", out, "--dtype", "float32", "--quiet",
                   "--quantization", "auto", "--max-ppl-increase", "0", "--auto-candidates", "int4",
                   "--calibration-samples", "8"])
    err = capsys.readouterr().err
    assert rc == 3
    assert "--max-ppl-increase 0.0 cannot be met" in err
    cfg = EngineConfig.load(out)
    assert cfg.quantization.budget["met"] is False and cfg.quantization.budget["measured_ppl_increase_pct"] > 0
    assert all(cfg.quantization.layers[n].method == "int4" for n in LINEAR_NAMES)


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.usefixtures("tp_timeout")
def test_mixed_auto_engine_at_tp2_equals_tp1(tiny_checkpoint, tmp_path):
    """Float layer 0 (--exclude-modules), int4 elsewhere with per-layer group sizes, int8 head:
    the TP = 2 build picks only groups its ranks hold whole, and gives the tokens of a TP = 1
    engine of the same plan (up to bfloat16 near-ties, as for GPTQ at TP 2)."""
    ckpt = tiny_checkpoint("llama", **DIMS)
    dirs = {}
    for n in (1, 2):
        dirs[n] = str(tmp_path / f"tp{n}")
        build_engine(BuildOptions(source=ckpt, output=dirs[n], quantization="auto", max_ppl_increase=1000.0,
                                  exclude_modules="layers.0.*", tensor_parallel_size=n, **FAST))
    assert EngineConfig.load(dirs[2]).tensor_parallel_size == 2
    l1, l2 = (EngineConfig.load(dirs[n]).quantization.layers for n in (1, 2))
    assert {l2[n].method for n in LINEAR_NAMES} == {"none", "int4"}
    # o_proj's 128 inputs are split by head (64 per rank): its groups of 128 would straddle the
    # ranks, so at TP 2 it takes groups of 64 where TP 1 takes 128
    assert l1["layers.1.o_proj"].group_size == 128 and l2["layers.1.o_proj"].group_size == 64
    assert {l2[n].group_size for n in LINEAR_NAMES if l2[n].method == "int4"} == {64, 128}
    # so compare TP 2 with a TP 1 engine of the same plan
    dirs[1] = _build_with_plan(ckpt, {k: v for k, v in l2.items()}, tmp_path / "tp1-same-plan")
    prompts = [PROMPT, [1, 600, 601, 602]]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    logs, toks = {}, {}
    for n in (1, 2):
        kw = dict(threads_per_rank=1) if n == 2 else {}
        with LLMEngine(dirs[n], device="cpu", num_kv_blocks=64, **kw) as eng:
            logs[n] = record_logits(eng)
            toks[n] = [o.outputs[0].token_ids for o in eng.generate(prompt_token_ids=prompts, params=greedy)]
    for s, (a, b) in enumerate(zip(toks[1], toks[2])):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        for step in range(same):
            assert rel_err(logs[2][step][s], logs[1][step][s]) < 2e-2
        if same < len(a):
            row = logs[1][same][s]
            assert abs(row[a[same]] - row[b[same]]).item() < 0.02, (s, same)
