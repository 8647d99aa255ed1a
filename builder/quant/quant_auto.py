"""`tritium build SRC --quantization auto --max-ppl-increase PCT`: per-layer precision under a
quality budget.

1. Candidates per linear (quant_auto_sensitivity.py): int4 with each group size that fits (the
   GGUF source grid first), per-row int8, float; the embedding / LM head as per-row int8 or
   float. --auto-candidates narrows the kinds; --exclude-modules keeps linears float.
   At tensor parallelism, int4 group sizes that a rank would split are not candidates.
2. Sensitivity: the KL each (linear, candidate) adds alone, on a small calibration batch.
3. Allocation (quant_auto_alloc.py): a ladder of assignments from the fewest bytes to the most
   precise, each on the additive model's Pareto front.
4. Verification: the smallest rung whose *measured* perplexity increase on a held-out slice
   (the builder's evaluation text, never the calibration text) is within the budget, by
   bisection along the ladder; the model for each check is the float model with the candidates'
   runtime modules swapped in, so no additivity is trusted at this step.
5. The chosen plan is built by the ordinary pipeline (quant_pipeline.py, the int4 layers with
   --auto-int4-method) and measured again on the same slice; if the real build misses the budget
   (GPTQ / AWQ's layer-by-layer calibration differs slightly from the isolated rounding), a more
   precise rung is built, at most MAX_BUILDS times.
When even the most precise rung misses, the engine is still written with it and
engine.json's quantization.budget says met: false; `tritium build` then exits with status 3.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Dict, Optional, Sequence, Tuple

import torch
from tqdm import tqdm

from tritium.backend.config import EngineConfig, KVCacheConfig, LayerQuant, QuantConfig
from tritium.backend.parallel_layout import TensorParallelError, plan_layout

from .. import calibration as calib
from . import quant_auto_budget as budget_mix
from .quant_auto_alloc import Option, allocation_ladder, total_bytes, total_sensitivity
from .quant_auto_sensitivity import (AUTO_INT4_METHODS, AUTO_KINDS, INT4_GROUP_SIZES, SENSITIVITY_SAMPLES,
                                     candidate_layer_quants, measure_sensitivities, swap_module)
from .quant_eval import window_log_probs, windows
from .quant_plan import excluded, plan_layers
from .quant_pipeline import (DEFAULT_EVAL_TOKENS, QuantOptions, _float_model, _read_text,
                             load_source_tokenizer, quantize_engine_weights, validate_quant_args)

# RTN: the verified model then *is* the built one (no calibration differs between the two), and
# on a block-quantized source (SmolLM2's Q4_1 GGUF) int4 on the source grid is exact under RTN.
# AWQ / GPTQ round off-grid layers better (so more of them can take int4) at more build time;
# their final build is re-measured and rebuilt more precisely if it misses (see the table in
# docs/quantization.md).
DEFAULT_AUTO_INT4_METHOD = "int4-rtn"
MAX_BUILDS = 3
BUDGET_NOT_MET_EXIT = 3  # `tritium build` exit status when the budget cannot be met


def parse_candidates(text: Optional[str]) -> Tuple[str, ...]:
    """--auto-candidates 'int4,int8,none' -> ('int4', 'int8', 'none') (default: all kinds)."""
    if text is None:
        return AUTO_KINDS
    kinds = tuple(dict.fromkeys(k.strip() for k in str(text).split(",") if k.strip()))
    bad = [k for k in kinds if k not in AUTO_KINDS]
    if bad or not kinds:
        raise ValueError(f"--auto-candidates {text!r}: expected a comma-separated list of "
                         f"{', '.join(AUTO_KINDS)} (e.g. 'int4,int8,none')")
    return kinds


def validate_auto_args(opts) -> None:
    """Check the --quantization auto flags (on every build: they are refused without auto)."""
    q = getattr(opts, "quantization", "none")
    budget = getattr(opts, "max_ppl_increase", None)
    given = {"--max-ppl-increase": budget, "--auto-int4-method": getattr(opts, "auto_int4_method", None),
             "--auto-candidates": getattr(opts, "auto_candidates", None)}
    if q != "auto":
        for flag, value in given.items():
            if value is not None:
                raise ValueError(f"{flag} applies only to --quantization auto (got --quantization {q})")
        return
    if budget is None:
        raise ValueError("--quantization auto needs a quality budget: --max-ppl-increase PCT, the allowed "
                         "perplexity increase in percent on held-out text (e.g. 0.5)")
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not math.isfinite(budget) or budget < 0:
        raise ValueError(f"--max-ppl-increase must be a finite number of percent >= 0, got {budget!r}")
    method = given["--auto-int4-method"]
    if method is not None and method not in AUTO_INT4_METHODS:
        raise ValueError(f"--auto-int4-method {method!r} not supported; allowed: {', '.join(AUTO_INT4_METHODS)}")
    parse_candidates(given["--auto-candidates"])


class HeldOutCheck:
    """Perplexity increase of the float model with some linears swapped for their quantized
    runtime modules, against the float model itself, on a fixed token slice (reference once)."""

    def __init__(self, model, modules: Dict[Tuple[str, str], torch.nn.Module], texts: Dict[str, Sequence[int]]):
        # texts: domain -> token ids (quant_auto_budget.budget_texts); the check is the worst domain
        self.model, self.modules = model, modules
        self.windows = {d: windows(ids, model.cfg.limits.max_seq_len) for d, ids in texts.items()}
        short = [d for d, w in self.windows.items() if not w]
        if short:
            raise ValueError(f"--quantization auto: the budget text of domain(s) {short} is too short")
        self.num_tokens = {d: sum(len(w) - 1 for w in ws) for d, ws in self.windows.items()}
        self.ref_nll = self._nll()
        self.last: Dict[str, float] = {}  # per-domain increases of the latest call

    @torch.no_grad()
    def _nll(self) -> Dict[str, float]:
        out = {}
        for d, ws in self.windows.items():
            nll = 0.0
            for w in ws:
                lp = window_log_probs(self.model, w)
                nll -= lp.gather(1, torch.tensor(w[1:])[:, None]).sum().item()
            out[d] = nll / self.num_tokens[d]
        return out

    def __call__(self, assignment: Dict[str, Option]) -> float:
        """Measured perplexity increase (a fraction) of `assignment` on its worst domain."""
        restores = [swap_module(self.model, name, self.modules.get((name, opt.name)))
                    for name, opt in assignment.items()]
        try:
            nll = self._nll()
            self.last = {d: math.exp(nll[d] - self.ref_nll[d]) - 1.0 for d in nll}
            return budget_mix.worst(self.last)
        finally:
            for restore in reversed(restores):
                restore()


def search_ladder(ladder, check, budget: float, progress: bool = True) -> Tuple[int, Dict[int, float]]:
    """(index of the smallest rung measured within `budget`, {rung: measured increase}); the top
    rung when even it misses. Bisection, assuming more precise rungs measure no worse."""
    results: Dict[int, float] = {}
    top = len(ladder) - 1
    bar = tqdm(total=2 + max(0, math.ceil(math.log2(max(1, top)))), desc="verifying on held-out text",
               unit="check", disable=not progress)

    def ok(i: int) -> bool:
        if i not in results:
            results[i] = check(ladder[i])
            bar.update()
        return results[i] <= budget
    try:
        if not ok(top) or ok(0):
            return (0 if results.get(0, math.inf) <= budget else top), results
        lo, hi = 0, top  # lo misses, hi meets
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if ok(mid) else (mid, hi)
        return hi, results
    finally:
        bar.close()


def _calibration_samples(tokenizer, o: QuantOptions):
    text = (_read_text(o.calibration_text, "--calibration-text") if o.calibration_text
            else calib.default_calibration_text())
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    return calib.calibration_samples(ids, o.calibration_samples)


def _candidates(cfg: EngineConfig, o: QuantOptions, method: str, kinds):
    base = dataclasses.replace(o, quantization=method, layer_plan=None, exclude_modules=None)
    int4_plans = {}
    if "int4" in kinds:
        int4_plans[0] = plan_layers(cfg, base)  # --group-size if given, else the source grid / default rule
        if not o.group_size_explicit:
            for g in INT4_GROUP_SIZES:
                try:
                    int4_plans[g] = plan_layers(cfg, dataclasses.replace(base, group_size=g, group_size_explicit=True))
                except ValueError:
                    pass  # no layer takes this group size
    cands = candidate_layer_quants(cfg, kinds, int4_plans, lambda n: excluded(n, o.exclude_modules))
    if o.tensor_parallel_size > 1:  # only int4 group sizes that every rank holds whole
        for name, c in cands.items():
            kept = {k: lq for k, lq in c.items() if _fits_tensor_parallel(cfg.model, name, lq, o.tensor_parallel_size)}
            cands[name] = kept or {"none": LayerQuant("none")}
    return cands


def _fits_tensor_parallel(m, name: str, lq: LayerQuant, n: int) -> bool:
    """Whether an int4 row-parallel linear's groups stay whole on each of n ranks (tp_shard.py):
    o_proj's inputs are split by attention head, down_proj's in units of its group size."""
    if lq.method != "int4":
        return True
    if name.endswith(".o_proj"):
        return all((r.q_heads[0] * m.head_dim) % lq.group_size == 0 and (r.num_heads * m.head_dim) % lq.group_size == 0
                   for r in plan_layout(m, n))
    if name.endswith(".down_proj"):
        try:
            plan_layout(m, n, lq.group_size)
        except TensorParallelError:
            return False
    return True


def quantize_auto(cfg: EngineConfig, tensors: Dict[str, torch.Tensor], opts=None, *, tokenizer=None,
                  model_factory=None, **kw) -> Tuple[Dict[str, torch.Tensor], QuantConfig, KVCacheConfig, dict]:
    """quantize_engine_weights for --quantization auto (same arguments and returns). The report
    gains an 'auto' section: every linear's choice and options, the search, the measured result."""
    o = QuantOptions.of(opts, **kw)
    validate_auto_args(o)
    validate_quant_args(o, cfg)
    t0 = time.time()
    budget = o.max_ppl_increase / 100.0
    method = o.auto_int4_method or DEFAULT_AUTO_INT4_METHOD
    kinds = parse_candidates(o.auto_candidates)
    tokenizer = tokenizer or load_source_tokenizer(o.source)
    if tokenizer is None:
        raise ValueError("--quantization auto measures perplexity: it needs the source's tokenizer "
                         "(tokenizer.json or a GGUF vocabulary)")
    cands = _candidates(cfg, o, method, kinds)
    samples = _calibration_samples(tokenizer, o)
    model = _float_model(cfg, tensors, model_factory)
    calib_runner = calib.LayerwiseRunner(model, samples) if method != "int4-rtn" and "int4" in kinds else None
    measured, modules = measure_sensitivities(model, cands, method, samples[:SENSITIVITY_SAMPLES],
                                              calib_runner, o.progress)
    del calib_runner
    options = {name: [Option(c, b, s) for c, (b, s) in d.items()] for name, d in measured.items()}
    ladder = allocation_ladder(options)
    eval_tokens = o.eval_tokens or DEFAULT_EVAL_TOKENS
    check = HeldOutCheck(model, modules, budget_mix.budget_texts(tokenizer, eval_tokens))
    accept = budget_mix.accept_threshold(budget)  # the budget less the margin kept for unseen text
    idx, results = search_ladder(ladder, check, accept, o.progress)
    del model, modules, check
    top = len(ladder) - 1
    builds = []
    while True:
        plan = {name: cands[name][opt.name] for name, opt in ladder[idx].items()}
        o2 = dataclasses.replace(o, quantization=method, layer_plan=plan, eval_tokens=eval_tokens,
                                 exclude_modules=None, max_ppl_increase=None, auto_int4_method=None,
                                 auto_candidates=None)
        new, qcfg, kvcfg, report = quantize_engine_weights(cfg, tensors, o2, tokenizer=tokenizer,
                                                           model_factory=model_factory)
        increase = report["eval"]["budget_check"]["perplexity_increase"]  # the worst budget domain
        builds.append({"rung": idx, "bytes": _nbytes(new), "ppl_increase_pct": 100 * increase})
        if increase <= accept or idx == top or len(builds) == MAX_BUILDS:
            break
        idx = min(top, idx + max(1, (top - idx) // 2))
    met = increase <= budget
    chosen = ladder[idx]
    counts: Dict[str, int] = {}
    for opt in chosen.values():
        counts[opt.name] = counts.get(opt.name, 0) + 1
    summary = {"max_ppl_increase_pct": o.max_ppl_increase, "measured_ppl_increase_pct": 100 * increase,
               "met": met, "held_out_text": report["eval"]["budget_check"]["text"],
               "held_out_tokens": report["eval"]["budget_check"]["tokens"],
               "budget_check": budget_mix.describe(report["eval"]["budget_check"]["domains"], budget,
                                                   report["eval"]["budget_check"]["tokens_per_domain"]),
               "int4_method": method, "choices": dict(sorted(counts.items()))}
    qcfg = dataclasses.replace(qcfg, method="auto", group_size=None, budget=summary)
    report["method"] = "auto"
    report["auto"] = {
        **summary, "candidates": list(kinds), "seconds": round(time.time() - t0, 2),
        "sensitivity": f"mean KL(float || model) with one linear rounded, {sum(map(len, samples[:SENSITIVITY_SAMPLES]))} "
                       "calibration tokens",
        "ladder_rungs": len(ladder),
        "search": [{"rung": i, "linear_bytes": total_bytes(ladder[i]), "predicted_kl": total_sensitivity(ladder[i]),
                    "ppl_increase_pct": 100 * r, "met": r <= accept} for i, r in sorted(results.items())],
        "builds": builds,
        "layers": {name: {"choice": chosen[name].name, "bytes": chosen[name].num_bytes,
                          "sensitivity_kl": chosen[name].sensitivity,
                          "options": {c: {"bytes": b, "sensitivity_kl": s} for c, (b, s) in measured[name].items()}}
                   for name in measured},
    }
    return new, qcfg, kvcfg, report


def _nbytes(tensors) -> int:
    return int(sum(t.numel() * t.element_size() for t in tensors.values()))
