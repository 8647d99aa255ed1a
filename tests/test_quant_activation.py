"""Integer-dot activation quantization end to end (docs/quantization.md#integer-dot-w8a8--w4a8):
SmoothQuant against its paper's definition, `tritium build --activation-quant int8` engines against
an oracle that fake-quantizes activations on the dequantized weights, the runtime option, batch
invariance of the layers, and bad flags."""
from __future__ import annotations

import json
import os

import pytest
import torch

from tritium.backend import quant
from tritium.backend.loader import load_engine
from tritium.kernels import cpu_native
from tritium.kernels import i8dot_pack as ip
from tests.test_quant_pipeline import DIMS, PROMPT, _dequantized_model, _logits

pytestmark = pytest.mark.skipif(not cpu_native.available(),
                                reason="native CPU kernels unavailable (TRITIUM_NATIVE_CPU=0 or no compiler): "
                                       "activation quantization falls back to weight-only there")


@pytest.fixture(scope="module")
def engines(tiny_checkpoint, tmp_path_factory):
    from tritium.builder.build import BuildOptions, build_engine
    cache = {}

    def make(**kw):
        key = tuple(sorted(kw.items()))
        if key not in cache:
            out = str(tmp_path_factory.mktemp("actq") / "engine")
            build_engine(BuildOptions(source=tiny_checkpoint("llama", **DIMS), output=out, dtype="float32",
                                      progress=False, calibration_samples=8, eval_tokens=0, **kw))
            cache[key] = out
        return cache[key]
    return make


def _input_amax(model, lin_name: str, layer: int = 0):
    """Per-channel max |x| at layer `layer`'s linear over PROMPT."""
    got = {}
    mod = getattr(model.layers[layer], lin_name)
    h = mod.register_forward_pre_hook(lambda _m, a: got.__setitem__("x", a[0].reshape(-1, a[0].shape[-1]).float()))
    _logits(model, PROMPT)
    h.remove()
    return got["x"].abs().amax(0)


def test_smoothquant_is_exact_and_balances_ranges(engines):
    """In float, smoothing changes nothing but the split of each channel's range between x and W;
    with alpha = 0.5 the paper's factors make max|X'_j| = max|W'_j| = sqrt(max|X_j| max|W_j|)."""
    from tritium.builder.quant.smoothquant_search import smooth_engine_tensors
    from tritium.builder.quant import quant_pipeline as qp
    from tritium.builder import calibration as calib
    from tritium.builder.quant.quant_plan import plan_layers
    fdir = engines()
    cfg, fmodel, _ = load_engine(fdir, "cpu")
    from safetensors.torch import load_file
    tensors = load_file(os.path.join(fdir, cfg.weights_file(0)))
    plan = plan_layers(cfg, qp.QuantOptions(quantization="int8"))
    runner = calib.LayerwiseRunner(qp._float_model(cfg, tensors), [PROMPT])  # the same tokens as _input_amax
    new, report = smooth_engine_tensors(cfg, tensors, runner, plan, 0.5)
    assert report["linears"] == 4 * cfg.model.num_layers
    smoothed = qp._float_model(cfg, new)
    ref, got = _logits(fmodel, PROMPT), _logits(smoothed, PROMPT)
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max(), "SmoothQuant changed the float model's output"
    for lin in ("qkv_proj", "gate_up_proj", "down_proj"):
        x0, x1 = _input_amax(fmodel, lin), _input_amax(smoothed, lin)
        w1 = new[f"layers.0.{lin}.weight"].abs().amax(0)
        w0 = tensors[f"layers.0.{lin}.weight"].abs().amax(0)
        ok = (x0 > 1e-6) & (w0 > 0)
        assert torch.allclose(x1[ok], (x0 * w0).sqrt()[ok], rtol=1e-3), f"{lin}: not the paper's factors"
        if lin == "down_proj":  # (qkv's v rows and gate_up's up rows are scaled again for o / down)
            assert torch.allclose(x1[ok], w1[ok], rtol=1e-3), f"{lin}: ranges not balanced"


def _folded_int4(qdir: str, name: str, cfg) -> torch.Tensor:
    """An int4 layer's float64 weights (N, K) from the stored layout with the folded zeros'
    definition (kernels/i8dot_pack.py): w = s (q - 8) + round(8 z / s) s / 8, per group."""
    from safetensors.torch import load_file
    t = load_file(os.path.join(qdir, cfg.weights_file(0)))
    q, s, z = t[f"{name}.qweight"], t[f"{name}.scales"].double(), t[f"{name}.zeros"].double()
    c = torch.stack((q & 0x0F, q >> 4), dim=2).reshape(q.shape[0], -1).double() - 8
    g = c.shape[1] // s.shape[0]
    zr = torch.where(s != 0, torch.round(8 * z / torch.where(s != 0, s, torch.ones_like(s))) * s / 8, z)
    return c * s.t().repeat_interleave(g, 1) + zr.t().repeat_interleave(g, 1)


def _fake_quant(x: torch.Tensor) -> torch.Tensor:
    """x with each row's blocks of 32 replaced by their int8 quantization (the definition)."""
    x2 = x.reshape(-1, x.shape[-1])
    q, d = ip.quantize_q8_ref(x2)
    return (q.view(q.shape[0], -1, 32).double() * d.double()[:, :, None]).view(x2.shape)


@pytest.mark.parametrize("method", ["int8", "int4-rtn"])
def test_activation_quant_engine_matches_fake_quant_oracle(engines, method):
    """Every quantized linear of an --activation-quant int8 engine, on the inputs it saw in a
    forward pass, against the oracle: the stored layout dequantized with its formulas
    (test_quant_pipeline._dequantized_model, no quantized kernel) times the activations quantized
    per 32-block by the definition (int4: its zeros folded into the codes, rounded to 1/8 of the
    scale, kernels/i8dot_pack.py). End to end, the engine stays close to the weight-only numerics."""
    from tritium.backend.config import EngineConfig
    qdir = engines(quantization=method, activation_quant="int8")
    with open(os.path.join(qdir, "engine.json")) as f:
        raw = json.load(f)
    # SmoothQuant by default for int8 weights only (smoothquant.smoothquant_applies)
    assert raw["activation_quant"] == "int8"
    sq = raw["quantization"]["smoothquant"]
    if method == "int8":  # alpha 0.5 on every linear, the LM head centred
        assert sq == {"alpha": 0.5, "linears": 4 * raw["model"]["num_layers"]}
        head = "embed_tokens" if raw["model"]["tie_word_embeddings"] else "lm_head"
        assert raw["quantization"]["layers"][head]["centred"], "int8 W8A8 builds centre their LM head"
    else:
        assert sq == {}
    cfg, model, _ = load_engine(qdir, "cpu")
    names = [n for n, lq in EngineConfig.load(qdir).quantization.layers.items()
             if lq.method in ("int8", "int4") and n.startswith("layers.")]
    assert len(names) == 4 * cfg.model.num_layers
    seen = {}
    for n in names:
        _, i, lin = n.split(".")
        getattr(model.layers[int(i)], lin).register_forward_hook(
            lambda _m, a, o, n=n: seen.__setitem__(n, (a[0].detach().clone(), o.detach().clone())))
    got = _logits(model, PROMPT)
    kinds = {m._packed.kind for m in model.modules() if isinstance(m, (quant.Int8Linear, quant.Int4Linear))
             and m is not model.embed_tokens and m is not model.lm_head}
    assert kinds == {"i8dot"}, kinds
    head = model.lm_head or model.embed_tokens
    assert head._packed.kind == ("head6" if method == "int4-rtn" else "i8dot")  # int6 / int8 head
    dense = _dequantized_model(qdir)
    for n in names:
        _, i, lin = n.split(".")
        x, y = seen[n]
        packed = getattr(model.layers[int(i)], lin)._packed.tensors[0]
        if method == "int4-rtn":  # a min/max grid: every block's zero folds
            assert packed.fold, f"{n}: int4 zeros not folded"
            wt = _folded_int4(qdir, n, cfg)
        else:
            assert not packed.fold
            wt = getattr(dense.layers[int(i)], lin).weight.double()
        ref = _fake_quant(x) @ wt.t()
        # the same integer codes; only float32 sums differ
        err = (y.double().reshape(ref.shape) - ref).abs().max() / ref.abs().max()
        assert err <= 1e-5, f"{method} {n}: relative error {err:.3g}"
    quant.set_activation_quant(model, "none")  # the weight-only numerics of the same weights
    weight_only = _logits(model, PROMPT)
    assert not torch.equal(weight_only, got), "activation quantization had no effect"
    assert (weight_only.argmax(-1) == got.argmax(-1)).float().mean() >= 0.8


def test_runtime_option_turns_it_on_and_off(engines):
    """The engine option on a weight-only engine, and the flag that keeps the weight-only numerics
    on an --activation-quant int8 engine; bad values name the parameter."""
    from tritium.backend.engine import LLMEngine
    from tritium.backend.engine_options import engine_setup, options_from_params
    wdir = engines(quantization="int8", activation_quant="none")  # a weight-only engine (not the default)
    eng = LLMEngine(wdir, num_kv_blocks=16, **engine_setup(options_from_params({"activation_quant": "int8"})).engine_kwargs)
    assert eng.config.activation_quant == "int8"
    lins = [m for m in eng.runner.model.modules() if isinstance(m, quant.Int8Linear)]
    assert lins and all(m.activation_quant == "int8" for m in lins)
    adir = engines(quantization="int8", activation_quant="int8", smoothquant=False)
    off = LLMEngine(adir, num_kv_blocks=16, activation_quant="none")
    assert all(m.activation_quant == "none" for m in off.runner.model.modules()
               if isinstance(m, quant.Int8Linear))
    with pytest.raises(ValueError, match="parameter activation_quant must be one of none, int8"):
        options_from_params({"activation_quant": "int4"})


def test_layer_rows_are_batch_invariant(cpu_path):
    """W8A8 / W4A8 linears give a row the same bits alone, in a decode batch or in a prefill
    (one kernel for every row count), on every CPU path."""
    from types import SimpleNamespace
    from tritium.kernels.quant_layouts import pack_int4
    torch.manual_seed(3)
    n, k = 40, 160
    a = quant.Int8Linear(k, n, False, torch.bfloat16, SimpleNamespace(group_size=32, asymmetric=True))
    a.qweight.copy_(torch.randint(-128, 128, (n, k), dtype=torch.int8))
    a.scales.copy_(torch.rand(k // 32, n) / 30)
    a.zeros.copy_(torch.randn(k // 32, n) / 30)
    b = quant.Int4Linear(k, n, False, torch.bfloat16, SimpleNamespace(group_size=32))
    b.qweight.copy_(pack_int4(torch.randint(0, 16, (n, k))))
    b.scales.copy_(torch.rand(k // 32, n) / 10)
    b.zeros.copy_(torch.randn(k // 32, n) / 10)
    x = torch.randn(70, k).to(torch.bfloat16)
    for lin in (a, b):
        quant.set_activation_quant(lin, "int8")
        full = lin(x)
        assert lin._packed.kind == "i8dot"
        for m in (1, 3, 16):
            assert torch.equal(lin(x[:m]), full[:m])
        assert torch.equal(lin(x[69:70]), full[69:70])


@pytest.mark.parametrize("argv, message", [
    (["--no-smoothquant"], "need --activation-quant int8"),
    (["--activation-quant", "int8", "--quantization", "fp8"], "needs --quantization int8, int4"),
    (["--activation-quant", "int8", "--quantization", "int8", "--smoothquant-alpha", "1.5"], "must be a number in \\[0, 1\\] or auto"),
    (["--quantization", "int8", "--smoothquant-alpha", "half"], "--smoothquant-alpha must be a number in \\[0, 1\\] or auto, got 'half'"),
])
def test_bad_flags_fail_before_work(tiny_checkpoint, tmp_path, capsys, argv, message):
    from tritium.client.cli.main import main
    import re
    out = tmp_path / "e"
    rc = main(["build", tiny_checkpoint("llama", **DIMS), "-o", str(out), "--quiet"] + argv)
    err = capsys.readouterr().err
    assert rc == 2 and not out.exists() and re.search(message, err), err


def test_eval_cli_activation_quant(engines, capsys, tmp_path):
    """`tritium eval --activation-quant int8` scores the engine's W8A8 numerics (recorded in the
    JSON), and they differ from its weight-only numerics on the same text."""
    from tritium.client.cli.main import main
    qdir, fdir = engines(quantization="int8", activation_quant="none"), engines()  # weight-only build
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    res = {}
    for mode in ("none", "int8"):
        assert main(["eval", "--engine", qdir, "--reference", fdir, "--text", str(text), "--num-tokens", "120",
                     "--json", "--activation-quant", mode]) == 0
        res[mode] = json.loads(capsys.readouterr().out)
        assert res[mode]["activation_quant"] == mode and 0 <= res[mode]["mean_kl"] < 0.1
    assert res["int8"]["perplexity"] != res["none"]["perplexity"]


def test_smoothquant_default_per_weight_format():
    """SmoothQuant by default for int8 weights, not for int4 (measured: it migrates outliers into
    4-bit groups), forced by --smoothquant-alpha, never with --no-smoothquant."""
    from tritium.builder.quant.quant_pipeline import QuantOptions
    from tritium.builder.quant.smoothquant import smoothquant_applies
    assert smoothquant_applies(QuantOptions(quantization="int8", activation_quant="int8"))
    assert not smoothquant_applies(QuantOptions(quantization="int4-rtn", activation_quant="int8"))
    assert smoothquant_applies(QuantOptions(quantization="int4-rtn", activation_quant="int8", smoothquant_alpha=0.2))
    assert not smoothquant_applies(QuantOptions(quantization="int8", activation_quant="int8", smoothquant=False))
    assert not smoothquant_applies(QuantOptions(quantization="int8"))
