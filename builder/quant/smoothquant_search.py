"""SmoothQuant's migration strength chosen per linear by the calibration error.

SmoothQuant (Xiao et al., 2023) picks one alpha per model on calibration data (0.5 for most
models, larger where activation outliers are worse). One alpha does not fit every linear of a
small model: a linear whose inputs carry no outlier channels gains nothing from smoothing, and
the migrated factors take its weights off the source's quantization grid (a block-quantized
GGUF's int8 build is otherwise exact). So, like AWQ's grid search of its scale exponent per
layer (Lin et al., "AWQ: Activation-aware Weight Quantization for LLM Compression and
Acceleration", 2024), each linear here takes the candidate of least output error on calibration
rows, "not smoothed" among the candidates:

    err(c) = || Qa(X / s_c) Qw(W diag(s_c))^T - X W^T ||_F^2

X: a strided subsample of the float model's inputs to the linear over the calibration set; Qw:
the build's own rounding of the (smoothed) weight (quant_layers.quantize_weight: the source grid
where it holds, round to nearest otherwise); Qa: the runtime's activation quantization (bfloat16,
then int8 per row and block of 32, kernels/i8dot_pack.quantize_q8_ref). A tie keeps the linear
unsmoothed. A linear whose input width is not a multiple of 32 runs weight-only (no activation
rounding to fix) and is never smoothed.
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import torch

from tritium.kernels.i8dot_pack import QBLOCK, quantize_q8_ref

from .. import calibration as calib
from .quant_layers import LINEARS, quantize_weight
from .smoothquant import AUTO, input_factors, linear_factors, smooth_layer, smoothable

ALPHA_CANDIDATES = (None, 0.25, 0.5, 0.75, 0.9)  # None: not smoothed
SEARCH_ROWS = 1024  # calibration rows per linear scored per candidate


def fake_quant_activations(x: torch.Tensor) -> torch.Tensor:
    """x (M, K) as the integer-dot kernels see it: codes times their block scales, float32."""
    q, d = quantize_q8_ref(x.float())
    m, k = x.shape
    return (q.float().view(m, k // QBLOCK, QBLOCK) * d[:, :, None]).view(m, k)


def candidate_error(x: torch.Tensor, w: torch.Tensor, s: Optional[torch.Tensor], lq, method: str,
                    ref: Optional[torch.Tensor] = None) -> float:
    """err(c) of the module doc for input factors s (K,) (None: unsmoothed); ref: X W^T if known."""
    ref = x @ w.t() if ref is None else ref
    ws, xs = (w, x) if s is None else (w * s, x / s)
    _, deq = quantize_weight(ws, lq, method, None)
    return float((fake_quant_activations(xs) @ deq.float().t() - ref).pow(2).sum())


def choose_alphas(cfg, lins: Sequence[str], weights: Dict[str, torch.Tensor], x_amax: Dict[str, torch.Tensor],
                  rows: Dict[str, torch.Tensor], plan_of: Dict[str, object], method: str,
                  candidates=ALPHA_CANDIDATES) -> Dict[str, dict]:
    """{linear: {"alpha": the least-error candidate (None: unsmoothed), "errors": {candidate: err}}}
    for the linears `lins` of one layer (float weights, inputs' max |x| and sampled rows)."""
    out = {}
    for lin in lins:
        w, x = weights[lin].float(), rows[lin].float()
        if w.shape[1] % QBLOCK:
            out[lin] = {"alpha": None, "errors": {}}
            continue
        errors, ref = {}, x @ w.t()
        for a in candidates:
            s = None if a is None else input_factors(cfg, lin, linear_factors(cfg, lin, w, x_amax[lin], a))
            errors[a] = candidate_error(x, w, s, plan_of[lin], method, ref)
        best = min(candidates, key=lambda a: (errors[a], candidates.index(a)))
        out[lin] = {"alpha": best, "errors": errors}
    return out


def summarize(choices: Dict[str, dict]) -> dict:
    """The build report's view of the search: how many linears took each alpha, and the summed
    relative error reduction against unsmoothed over the calibration rows."""
    counts: Dict[str, int] = {}
    err_none = err_best = 0.0
    for c in choices.values():
        key = "none" if c["alpha"] is None else str(c["alpha"])
        counts[key] = counts.get(key, 0) + 1
        if c["errors"]:
            err_none += c["errors"][None]
            err_best += c["errors"][c["alpha"]]
    return {"alpha_counts": counts, "candidates": ["none" if a is None else a for a in ALPHA_CANDIDATES],
            "calibration_error_vs_unsmoothed": err_best / err_none if err_none else 1.0}


def smooth_engine_tensors(cfg, tensors: Dict[str, torch.Tensor], runner, plan: dict, alpha, method: str = "int8",
                          progress=None) -> Tuple[Dict[str, torch.Tensor], dict]:
    """SmoothQuant over every layer: runner is a calibration.LayerwiseRunner over the float model
    of `tensors`, or a function returning (runner, calibration provenance) (the build's
    calibration set); the linears smoothed are those `plan` quantizes to int8 or int4. alpha: a
    strength in [0, 1] for every linear, or AUTO (choose_alphas per linear, scored with the
    build's `method`). Returns (new tensors, report)."""
    if alpha != AUTO and not (isinstance(alpha, (int, float)) and 0.0 <= alpha <= 1.0):
        raise ValueError(f"--smoothquant-alpha must be in [0, 1] or {AUTO}, got {alpha!r}")
    info = None
    if callable(runner):
        runner, info = runner()
    new = dict(tensors)
    layers: dict = {}
    searched: Dict[str, dict] = {}
    stride = max(1, runner.num_tokens // SEARCH_ROWS)
    for i in range(cfg.model.num_layers):
        pre = f"layers.{i}."
        targets = {lin for lin in LINEARS if getattr(plan.get(pre + lin), "method", None) in ("int8", "int4")}
        layer = runner.model.layers[i]
        amax: Dict[str, torch.Tensor] = {}
        rows: Dict[str, list] = {}

        def on_input(name, x):
            a = x.abs().amax(0)
            amax[name] = a if name not in amax else torch.maximum(amax[name], a)
            if alpha == AUTO:
                rows.setdefault(name, []).append(x[::stride].float())
        mods = {lin: getattr(layer, lin) for lin in LINEARS if isinstance(getattr(layer, lin, None), torch.nn.Module)}
        handles = calib.capture_inputs(mods, on_input)
        try:
            runner.run_layer(i, advance=i < cfg.model.num_layers - 1)  # the float layer: exact either way
        finally:
            for h in handles:
                h.remove()
        layer_alpha = alpha
        if alpha == AUTO:
            lins = [lin for lin in smoothable(cfg, i, new, targets) if lin in amax]
            choices = choose_alphas(cfg, lins, {lin: new[pre + lin + ".weight"] for lin in lins}, amax,
                                    {lin: torch.cat(rows[lin])[:SEARCH_ROWS] for lin in lins},
                                    {lin: plan[pre + lin] for lin in lins}, method)
            layer_alpha = {lin: c["alpha"] for lin, c in choices.items()}
            searched.update({pre + lin: c for lin, c in choices.items()})
        layers.update(smooth_layer(cfg, i, new, amax, layer_alpha, targets))
        if progress is not None:
            progress.done(i)
    report = {"alpha": alpha, "linears": len(layers), "layers": layers}
    if alpha == AUTO:
        report.update(summarize(searched))
    return new, report if info is None else {**report, "calibration": info}
