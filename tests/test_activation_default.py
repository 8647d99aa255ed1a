"""The default activations of a build (`--activation-quant auto`, docs/quantization.md#integer-dot-w8a8--w4a8):
int8 (W8A8 / W4A8 on integer dot products, SmoothQuant for int8 weights) for the int8 and int4
methods Tritium quantizes itself, none for every other build; what the engine and the build
report record; an explicit `none` keeps the weight-only build bit for bit; refusals."""
from __future__ import annotations

import json
import os
import re

import pytest
import torch
from safetensors.torch import load_file

from tritium.backend import quant
from tritium.backend.loader import load_engine
from tritium.kernels import cpu_native
from tests.test_quant_pipeline import DIMS, PROMPT, _logits
from test_quant_int8_grouped import gguf_src  # noqa: F401 (fixture: a GGUF without a vocabulary)

INTEGER_DOT = ("int8", "int4-rtn", "int4-awq", "int4-gptq")


@pytest.fixture(scope="module")
def build(tiny_checkpoint, tmp_path_factory):
    """Factory: build(*cli_flags) -> (engine dir, the build's stderr), through `tritium build` (cached)."""
    from tritium.client.cli.main import main
    cache = {}

    def make(*flags):
        if flags not in cache:
            out = str(tmp_path_factory.mktemp("actdef") / "engine")
            import contextlib
            import io
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                rc = main(["build", tiny_checkpoint("llama", **DIMS), "-o", out, "--quiet", "--dtype", "float32",
                           "--calibration-samples", "8", "--eval-tokens", "0", *flags])
            assert rc == 0, err.getvalue()
            cache[flags] = (out, err.getvalue())
        return cache[flags]
    return make


def _json(engine_dir, name):
    with open(os.path.join(engine_dir, name), encoding="utf-8") as f:
        return json.load(f)


def test_resolution_table():
    """Which method gives which activations; explicit values kept; the defaults of the CLI, of
    BuildOptions and of a hand-made QuantOptions (the library's weight-only default)."""
    from tritium.builder.build import BuildOptions
    from tritium.builder.quant.quant_pipeline import QuantOptions
    from tritium.builder.quant.smoothquant import ACTIVATION_QUANT_CHOICES, resolve_activation_quant
    from tritium.client.cli.main import build_parser
    table = {"none": "none", "fp8": "none", "auto": "none", **{m: "int8" for m in INTEGER_DOT}}
    for method, want in table.items():
        assert resolve_activation_quant("auto", method) == want, method
        assert resolve_activation_quant("none", method) == "none"
    for method in INTEGER_DOT:
        assert resolve_activation_quant("int8", method) == "int8"
    with pytest.raises(ValueError, match=r"--activation-quant 'int7' not supported; allowed: auto, none, int8"):
        resolve_activation_quant("int7", "int8")
    assert ACTIVATION_QUANT_CHOICES == ("auto", "none", "int8")
    assert BuildOptions(source="s", output="o").activation_quant == "auto"
    args = build_parser().parse_args(["build", "src", "-o", "out"])
    assert args.activation_quant == "auto"
    assert QuantOptions(quantization="int4-gptq", activation_quant="auto").activation_quant == "int8"
    assert QuantOptions(quantization="int8").activation_quant == "none"


@pytest.mark.skipif(not cpu_native.available(), reason="native CPU kernels unavailable (TRITIUM_NATIVE_CPU=0 or "
                    "no compiler): integer-dot activations fall back to weight-only there")
@pytest.mark.parametrize("method", ["int8", "int4-rtn"])
def test_default_build_is_integer_dot(build, method):
    """A default int8 / int4 build: engine.json and build_report.json say int8 activations, the
    console line names W8A8 / W4A8 and SmoothQuant's settings (int8 weights: alpha 0.5 on every
    linear, the LM head centred; int4: off, and why), and the loaded engine's linears run the integer-dot kernel."""
    out, err = build("--quantization", method)
    raw, report = _json(out, "engine.json"), _json(out, "build_report.json")
    n_lin = 4 * raw["model"]["num_layers"]
    assert raw["activation_quant"] == "int8" and report["activation_quant"] == "int8"
    qr = report["quantization_report"]
    assert qr["activation_quant"] == "int8"
    if method == "int8":
        assert raw["quantization"]["smoothquant"] == {"alpha": 0.5, "linears": n_lin}
        assert qr["smoothquant"]["alpha"] == 0.5 and qr["smoothquant"]["linears"] == n_lin
        head = "embed_tokens" if raw["model"]["tie_word_embeddings"] else "lm_head"
        assert raw["quantization"]["layers"][head]["centred"] and qr["layers"][head]["head"]
        assert re.search(rf"activations: int8 .*\(W8A8; GPUs run weight-only\); SmoothQuant alpha 0.5 on {n_lin} "
                         rf"linears; engine option activation_quant=none", err), err
    else:
        assert raw["quantization"]["smoothquant"] == {}
        assert qr["smoothquant"].startswith("off (int4 weights")
        assert "(W4A8; GPUs run weight-only); SmoothQuant off (int4 weights" in err, err
    cfg, model, _ = load_engine(out, "cpu")
    assert cfg.activation_quant == "int8"
    _logits(model, PROMPT)
    lins = [m for m in model.modules() if isinstance(m, (quant.Int8Linear, quant.Int4Linear))
            and not isinstance(m, quant.Int6Linear)]
    assert len(lins) >= n_lin and {m._packed.kind for m in lins} == {"i8dot"}


def test_builds_without_integer_dot_stay_weight_only(build):
    """Float and fp8 builds resolve auto to none: nothing smoothed, the console says so."""
    for flags in ((), ("--quantization", "fp8")):
        out, err = build(*flags)
        raw, report = _json(out, "engine.json"), _json(out, "build_report.json")
        assert raw["activation_quant"] == "none" and report["activation_quant"] == "none", flags
        assert raw["quantization"].get("smoothquant", {}) == {}
        assert "activations: not quantized (weight-only)" in err, err


def test_explicit_none_is_the_weight_only_build(build):
    """`--activation-quant none`: the weights are bit for bit those of the weight-only pipeline
    (quantize_engine_weights with its library default) on the float engine's tensors, the norms
    are the float model's (nothing smoothed: the default build's differ), and the loaded linears
    keep the weight-only kernels."""
    from tritium.backend.config import EngineConfig
    from tritium.builder.quant.quant_pipeline import quantize_engine_weights
    out, err = build("--quantization", "int8", "--activation-quant", "none")
    fdir, _ = build()
    sq, _ = build("--quantization", "int8")
    raw, report = _json(out, "engine.json"), _json(out, "build_report.json")
    assert raw["activation_quant"] == "none" and raw["quantization"]["smoothquant"] == {}
    assert report["activation_quant"] == "none" and "activation_quant" not in report["quantization_report"]
    assert "activations: weight-only (W8A16 / W4A16 numerics; --activation-quant int8" in err, err
    got = load_file(os.path.join(out, "rank0.safetensors"))
    floats = load_file(os.path.join(fdir, "rank0.safetensors"))
    want, _, _, _ = quantize_engine_weights(EngineConfig.load(fdir), floats, quantization="int8", eval_tokens=0,
                                            progress=False, source=None)
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    smoothed = load_file(os.path.join(sq, "rank0.safetensors"))
    norm = "layers.0.input_norm.weight"
    assert torch.equal(got[norm], floats[norm]) and not torch.equal(smoothed[norm], floats[norm])
    _, model, _ = load_engine(out, "cpu")
    _logits(model, PROMPT)
    lins = [m for m in model.modules() if isinstance(m, quant.Int8Linear)]
    assert lins and all(m.activation_quant == "none" and m._packed.kind != "i8dot" for m in lins)


@pytest.mark.parametrize("argv, message", [
    (["--activation-quant", "int7"], r"argument --activation-quant: invalid choice: 'int7' \(choose from 'auto', "
                                     r"'none', 'int8'\)"),
    (["--smoothquant-alpha", "0.3"], r"need --activation-quant int8 .*this build's activations: none"),
    (["--quantization", "fp8", "--no-smoothquant"], r"need --activation-quant int8"),
    (["--activation-quant", "int8", "--quantization", "auto", "--max-ppl-increase", "1"],
     r"--activation-quant int8 is not available with --quantization auto"),
    (["--activation-quant", "int8"], r"needs --quantization int8, int4-rtn, int4-awq or int4-gptq, got none"),
])
def test_refusals_name_the_flag(tiny_checkpoint, tmp_path, capsys, argv, message):
    """Bad values and combinations: exit 2, one error line naming the flag, no engine written."""
    from tritium.client.cli.main import main
    out = tmp_path / "e"
    try:
        rc = main(["build", tiny_checkpoint("llama", **DIMS), "-o", str(out), "--quiet"] + argv)
    except SystemExit as e:  # argparse's own refusal of a value outside `choices`
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and not out.exists() and re.search(message, err), err
    assert len([line for line in err.splitlines() if "error" in line]) == 1, err


def test_build_options_refuse_a_bad_value_before_work(tiny_checkpoint, tmp_path):
    from tritium.builder.build import BuildOptions, build_engine
    with pytest.raises(ValueError, match=r"--activation-quant 'w8a8' not supported; allowed: auto, none, int8"):
        build_engine(BuildOptions(source=tiny_checkpoint("llama", **DIMS), output=str(tmp_path / "e"),
                                  quantization="int8", activation_quant="w8a8", progress=False))
    assert not (tmp_path / "e").exists()


@pytest.fixture(scope="module")
def adapter(tiny_checkpoint, tmp_path_factory):
    from transformers import AutoModelForCausalLM
    from lora_utils import make_peft_adapter
    base = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("llama", **DIMS), dtype=torch.float32)
    out = str(tmp_path_factory.mktemp("actdef-lora") / "a")
    make_peft_adapter(base, out, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    return out


def test_smoothed_engine_refuses_lora_and_build_with_lora_is_not_smoothed(build, adapter, tmp_path):
    """SmoothQuant scales each linear's input, which an adapter was not trained on: a default
    (smoothed) int8 engine refuses adapters naming the fix; `tritium build --lora` turns SmoothQuant
    off (int8 activations kept) and its adapter then moves the logits as on the weight-only engine
    of the same weights."""
    from tritium.backend.engine import LLMEngine
    from tritium.backend.lora.manager import LoRAConfig
    from lora_utils import engine_logits, rel_err
    sq, _ = build("--quantization", "int8")
    with pytest.raises(ValueError, match=r"LoRA: this engine was built with SmoothQuant .*--no-smoothquant"):
        LLMEngine(sq, device="cpu", num_kv_blocks=16, lora=LoRAConfig({"a": adapter}))
    out, err = build("--quantization", "int8", "--repo", str(tmp_path / "repo"), "--lora", f"a={adapter}")
    raw = _json(out, "engine.json")
    assert raw["activation_quant"] == "int8" and raw["quantization"]["smoothquant"] == {}
    assert "SmoothQuant off" in err and "SmoothQuant is off because the engine serves --lora adapters" in err, err
    with pytest.raises(ValueError, match="--smoothquant-alpha: SmoothQuant scales each linear's input"):
        from tritium.client.cli.build_cli import options_from_args
        from tritium.client.cli.main import build_parser
        options_from_args(build_parser().parse_args(
            ["build", "src", "-o", "o", "--quantization", "int8", "--smoothquant-alpha", "0.5", "--lora", f"a={adapter}"]))
    deltas = {}
    for mode in ("int8", "none"):
        eng = LLMEngine(out, device="cpu", num_kv_blocks=16, activation_quant=mode, lora=LoRAConfig({"a": adapter}))
        deltas[mode] = engine_logits(eng, PROMPT, "a") - engine_logits(eng, PROMPT)
    assert deltas["none"].abs().max() > 0.1  # the adapter moves the logits
    assert rel_err(deltas["int8"], deltas["none"]) < 0.1, rel_err(deltas["int8"], deltas["none"])


def test_gguf_source_without_vocabulary_gets_w8a8_unsmoothed(gguf_src, tmp_path):
    """A GGUF source resolves like a Hugging Face one (int8 activations for --quantization int8);
    one without a vocabulary has no calibration text, so SmoothQuant is skipped and the report
    says why (the build does not fail)."""
    from tritium.builder.build import BuildOptions, build_engine
    src, _ = gguf_src
    out = str(tmp_path / "e")
    cfg = build_engine(BuildOptions(source=src, output=out, dtype="float32", progress=False, quantization="int8"))
    assert cfg.activation_quant == "int8" and cfg.quantization.smoothquant == {}
    report = _json(out, "build_report.json")
    assert report["quantization_report"]["smoothquant"] == "off (the source has no tokenizer for the calibration text)"


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "olmo2",
                                    "granite", "smollm3"])
def test_smoothquant_is_exact_in_float_for_every_dense_family(tiny_engine, family):
    """SmoothQuant now runs in every default int8 build, so its folds (norm weights, v rows, up
    rows) must be exact for every family's layer: in float the smoothed model gives the float
    model's logits (Gemma's stored 1 + w norms, q / k norms, biases, multipliers, post-norm OLMo 2
    whose linears have no norm before them and are left as they are)."""
    from tritium.builder import calibration as calib
    from tritium.builder.quant import quant_pipeline as qp
    from tritium.builder.quant.quant_plan import plan_layers
    from tritium.builder.quant.smoothquant_search import smooth_engine_tensors
    fdir = tiny_engine(family)
    cfg, fmodel, _ = load_engine(fdir, "cpu")
    tensors = load_file(os.path.join(fdir, cfg.weights_file(0)))
    plan = plan_layers(cfg, qp.QuantOptions(quantization="int8"))
    runner = calib.LayerwiseRunner(qp._float_model(cfg, tensors), [PROMPT])
    new, report = smooth_engine_tensors(cfg, tensors, runner, plan, 0.5)
    assert report["linears"] > 0 or family == "olmo2", report["linears"]
    changed = [n for n in tensors if not torch.equal(tensors[n], new[n])]
    assert changed or family == "olmo2"
    ref, got = _logits(fmodel, PROMPT), _logits(qp._float_model(cfg, new), PROMPT)
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max(), (family, (got - ref).abs().max().item())
