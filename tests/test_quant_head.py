"""The int8 LM head of int4 builds: GPTQ and AWQ on quantize_int8's grid against plain rounding,
judged by the output error ||X W^T - X Q^T|| the papers minimise, and the tied AWQ head's
lookup and logits against the float model."""
import pytest
import torch

from tritium.builder.quant.awq import awq_clip_rows_int8, awq_search_scale, fake_quantize_int8_rows
from tritium.builder.quant.gptq import HessianAccumulator
from tritium.builder.quant.gptq_rows import gptq_int8_quantize, gptq_rows
from tritium.builder.quant.quant_head import quantize_embeddings
from tritium.builder.quant.quantize_int8 import dequantize_int8, int8_row_scales, quantize_int8
from tritium.backend.config import LayerQuant


def correlated_inputs(n, k, seed, outliers=()):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k ** 0.5 + torch.eye(k)
    x = torch.randn(n, k, generator=g) @ mix
    for c in outliers:
        x[:, c] *= 40.0  # the "massive activation" channels final hidden states have
    return x


def head_stats(x):
    """collect_head_stats' dict for head inputs x (n, K)."""
    acc = HessianAccumulator(x.shape[1])
    acc.add(x)
    return {"mean_abs": x.abs().mean(0), "mean": x.mean(0), "x": x, "H": acc.hessian()}


def out_err(x, w, deq):
    return ((x @ (deq - w).t()).norm() / (x @ w.t()).norm()).item()


def test_gptq_int8_beats_rtn_on_output_error():
    torch.manual_seed(0)
    w = torch.randn(300, 96)
    x = correlated_inputs(2048, 96, 1)
    acc = HessianAccumulator(96)
    acc.add(x)
    q, s = gptq_int8_quantize(w, acc.hessian())
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    rq, rs = quantize_int8(w)
    torch.testing.assert_close(s, rs)  # same grid (quantize_int8's layout), other codes
    e_gptq = out_err(x, w, dequantize_int8(q, s))
    e_rtn = out_err(x, w, dequantize_int8(rq, rs))
    assert e_gptq < 0.8 * e_rtn, (e_gptq, e_rtn)


def test_gptq_rows_with_identity_hessian_is_round_to_nearest():
    """With H = I no column's error is fed to another (H^-1's factor is diagonal): GPTQ is RTN."""
    torch.manual_seed(1)
    w = torch.randn(40, 24)
    scales = int8_row_scales(w)
    codes = gptq_rows(w, torch.eye(24) * 2, scales, lambda v: torch.round(v).clamp(-127, 127), damp_percent=0.0)
    torch.testing.assert_close(codes, torch.round(w / scales[:, None]).clamp(-127, 127))


def test_awq_head_search_protects_outlier_channels():
    torch.manual_seed(2)
    w = torch.randn(500, 64) * 0.05
    w[:, :4] *= 8.0  # rows' amax set by a few large weights, as in real embeddings
    x = correlated_inputs(512, 64, 3, outliers=(10, 20, 30))
    s, alpha, losses = awq_search_scale([w], x, x.abs().mean(0), None, fake_quant=fake_quantize_int8_rows)
    assert alpha > 0 and losses[int(alpha * 20)] < losses[0]
    assert s[10] > s.median() and s[20] > s.median() and s[30] > s.median()
    deq_awq = fake_quantize_int8_rows(w * s) / s
    assert out_err(x, w, deq_awq) < out_err(x, w, fake_quantize_int8_rows(w))


def _tied_head_case():
    torch.manual_seed(4)
    vocab, hidden = 400, 64
    w = torch.randn(vocab, hidden) * 0.05
    w[:, :3] *= 6.0
    x = correlated_inputs(600, hidden, 5, outliers=(7, 9))
    return w, x, {"embed_tokens.weight": w.clone(), "norm.weight": torch.ones(hidden) * 1.5}


def test_tied_awq_head_folds_into_the_norm_and_lookup_divides_back():
    w, x, tensors = _tied_head_case()
    plan = {"embed_tokens": LayerQuant("int8")}
    rep = quantize_embeddings(tensors, plan, "int4-awq", tied=True, head_stats=head_stats(x[:256] * 1.5))
    assert rep["embed_tokens"]["awq_alpha"] > 0 and rep["embed_tokens"]["head"]
    assert plan["embed_tokens"].input_scale
    s = tensors["embed_tokens.input_scale"]
    deq = dequantize_int8(tensors["embed_tokens.qweight"], tensors["embed_tokens.scales"])
    # lookup: the stored rows are W * s rounded to nearest on each row's int8 grid, so rows / s
    # is W within half a step / s
    step = tensors["embed_tokens.scales"][:, None]
    inside = (w * s).abs() <= 127 * step  # rows may be clipped by AWQ's clip search
    assert inside.float().mean() > 0.99
    assert ((deq - w * s).abs() <= step / 2 + 1e-6)[inside].all()
    assert ((deq / s - w).abs() <= step / (2 * s) + 1e-6)[inside].all()
    # head: (h * norm / s) @ deq^T is (h * norm) @ W^T, with less error than RTN's head
    h = x[256:]
    ref = (h * 1.5) @ w.t()
    got = (h * tensors["norm.weight"] - tensors["head_input_mean"]) @ deq.t() + tensors["head_mean_logits"]
    rq, rs = quantize_int8(w)
    rtn = (h * 1.5) @ dequantize_int8(rq, rs).t()
    assert (got - ref).norm() < (rtn - ref).norm()


def test_centred_awq_head_computes_the_mean_logits_in_float():
    """Final hidden states have a few channels that are large and nearly constant. Their rounding
    error shifts every token's logits by the same per-row amount, (W - Q) mu. The centred head
    computes ((x - mu) / s) Q^T + mu W^T: the mean input's logits exactly, from the float weights,
    so on the calibration inputs its error has zero mean per row (Nagel et al.'s bias
    correction), and on held-out inputs it is far closer to the float head than without it."""
    torch.manual_seed(9)
    vocab, hidden = 600, 64
    w = torch.randn(vocab, hidden) * 0.05
    w[:, :3] *= 6.0
    x = correlated_inputs(1200, hidden, 11)
    x[:, [7, 9]] = torch.tensor([25.0, -18.0]) + 0.3 * x[:, [7, 9]]  # near-constant, large channels
    calib, held = x[:600], x[600:]
    tensors = {"embed_tokens.weight": w.clone(), "norm.weight": torch.ones(hidden)}
    plan = {"embed_tokens": LayerQuant("int8")}
    rep = quantize_embeddings(tensors, plan, "int4-awq", tied=True, head_stats=head_stats(calib))
    assert plan["embed_tokens"].centred
    mean, mean_logits = tensors["head_input_mean"], tensors["head_mean_logits"]
    assert mean.shape == (hidden,) and mean_logits.shape == (vocab,)
    assert mean.dtype == mean_logits.dtype == torch.float32
    # the mean's logits come from the float weights, and the norm's fold divides the mean by s
    torch.testing.assert_close(mean * tensors["norm.weight"].reciprocal(), calib.mean(0), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mean_logits, calib.mean(0) @ w.t(), rtol=1e-5, atol=1e-4)
    deq = dequantize_int8(tensors["embed_tokens.qweight"], tensors["embed_tokens.scales"])

    def head(h, centred=True):
        x_in = h * tensors["norm.weight"]
        return (x_in - mean) @ deq.t() + mean_logits if centred else x_in @ deq.t()

    # on the calibration inputs the centred head's error has zero mean per vocabulary row
    torch.testing.assert_close((calib @ w.t() - head(calib)).mean(0), torch.zeros(vocab), atol=2e-4, rtol=0)
    assert rep["embed_tokens"]["bias_correction_rms"] == pytest.approx(
        float((calib @ w.t() - head(calib, centred=False)).mean(0).pow(2).mean().sqrt()), rel=1e-3)
    ref = held @ w.t()
    e_c = (head(held) - ref).norm()
    e_plain = (head(held, centred=False) - ref).norm()
    rq, rs = quantize_int8(w)
    e_rtn = (held @ dequantize_int8(rq, rs).t() - ref).norm()
    assert e_c < 0.7 * e_plain and e_c < 0.7 * e_rtn, (e_c, e_plain, e_rtn)


def test_tied_gptq_head_and_rtn_baseline():
    w, x, tensors = _tied_head_case()
    acc = HessianAccumulator(w.shape[1])
    acc.add(x[:256] * 1.5)
    t_gptq, t_rtn = dict(tensors), dict(tensors)
    rep = quantize_embeddings(t_gptq, {"embed_tokens": LayerQuant("int8")}, "int4-gptq", tied=True,
                              head_stats={"H": acc.hessian()})
    assert "GPTQ" in rep["embed_tokens"]["rounding"] and "embed_tokens.input_scale" not in t_gptq
    quantize_embeddings(t_rtn, {"embed_tokens": LayerQuant("int8")}, "int4-rtn", tied=True)
    h = x[256:] * 1.5
    deq = {k: dequantize_int8(t[k.split(":")[0] + ".qweight"], t[k.split(":")[0] + ".scales"])
           for k, t in (("embed_tokens:g", t_gptq), ("embed_tokens:r", t_rtn))}
    assert out_err(h, w, deq["embed_tokens:g"]) < out_err(h, w, deq["embed_tokens:r"])


def test_untied_embedding_keeps_round_to_nearest():
    """An untied embedding is a lookup only: no activation input, so every method rounds it."""
    w, x, tensors = _tied_head_case()
    tensors["lm_head.weight"] = w.clone() * 0.5
    plan = {"embed_tokens": LayerQuant("int8"), "lm_head": LayerQuant("int8")}
    rep = quantize_embeddings(tensors, plan, "int4-awq", tied=False, head_stats=head_stats(x[:256]))
    assert rep["embed_tokens"]["rounding"] == "round to nearest" and not rep["embed_tokens"]["head"]
    assert rep["lm_head"]["head"] and "awq_alpha" in rep["lm_head"]
    assert "embed_tokens.input_scale" not in tensors and not plan["embed_tokens"].input_scale
    q, s = quantize_int8(w)
    assert torch.equal(tensors["embed_tokens.qweight"], q)


def test_awq_clip_rows_never_worse_than_rtn_and_clips_an_outlier_row():
    torch.manual_seed(6)
    k = 48
    w = torch.randn(64, k) * 0.1
    w[5, 3] = 3.0   # one huge weight on a channel whose input is tiny: clipping it costs little
    x = correlated_inputs(400, k, 7)
    x[:, 3] *= 0.01
    H = x.t() @ x
    s = awq_clip_rows_int8(w, H)
    rtn_s = int8_row_scales(w)
    assert s[5] < rtn_s[5]  # row 5 clipped
    assert (s <= rtn_s + 1e-9).all()

    def row_err(scales):
        d = torch.round(w / scales[:, None]).clamp(-127, 127) * scales[:, None] - w
        return ((d @ H) * d).sum(1)
    assert (row_err(s) <= row_err(rtn_s) + 1e-9).all()
    assert row_err(s)[5] < 0.8 * row_err(rtn_s)[5]


def test_centring_is_a_choice_for_every_method():
    """centre=True adds the bias correction to any method's head (its rounding unchanged: the
    same int8 rows as without it); centre=False builds an AWQ head without it."""
    w, x, tensors = _tied_head_case()
    stats = head_stats(x[:256])
    acc = HessianAccumulator(w.shape[1])
    acc.add(x[:256])
    stats["H"] = acc.hessian()
    for method in ("int4-rtn", "int4-gptq"):
        plain, centred = dict(tensors), dict(tensors)
        p_plain, p_centred = {"embed_tokens": LayerQuant("int8")}, {"embed_tokens": LayerQuant("int8")}
        quantize_embeddings(plain, p_plain, method, tied=True, head_stats=stats)
        rep = quantize_embeddings(centred, p_centred, method, tied=True, head_stats=stats, centre=True)
        assert not p_plain["embed_tokens"].centred and "head_input_mean" not in plain
        assert p_centred["embed_tokens"].centred and rep["embed_tokens"]["bias_correction_rms"] > 0
        assert torch.equal(plain["embed_tokens.qweight"], centred["embed_tokens.qweight"])
        torch.testing.assert_close(centred["head_input_mean"], x[:256].mean(0))
        torch.testing.assert_close(centred["head_mean_logits"], x[:256].mean(0) @ w.t(), rtol=1e-5, atol=1e-4)
    rq, _ = quantize_int8(w)
    plain = dict(tensors)
    quantize_embeddings(plain, {"embed_tokens": LayerQuant("int8")}, "int4-rtn", tied=True, head_stats=stats)
    assert torch.equal(plain["embed_tokens.qweight"], rq)  # rtn stays round to nearest
    awq = dict(tensors)
    p_awq = {"embed_tokens": LayerQuant("int8")}
    rep = quantize_embeddings(awq, p_awq, "int4-awq", tied=True, head_stats=stats, centre=False)
    assert not p_awq["embed_tokens"].centred and "head_input_mean" not in awq
    assert "mean-centred" not in rep["embed_tokens"]["rounding"]
