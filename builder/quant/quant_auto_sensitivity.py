"""`--quantization auto`: candidate formats per linear, and each one's measured sensitivity.

A linear's sensitivity to a format is the mean KL(float || model) of the next-token
distributions on a small calibration batch when that linear alone is stored in that format and
everything else stays float: the layer-wise KL sensitivity of ZeroQ (Cai et al., 2020), a
measured stand-in for the second-order (Hessian-trace) sensitivity of HAWQ (Dong et al.,
"HAWQ: Hessian AWare Quantization of Neural Networks with Mixed-Precision", 2019). Layer i's
inputs are cached, so each measurement runs only layers i..L-1 and the head.

Each candidate is rounded the way the final build rounds it (int4: the build's
--auto-int4-method, GPTQ under the float model's Hessians, AWQ's searched scale s applied as
(x / s) Q(W s)^T; int8: per-row round to nearest) and runs in the runtime's own quantized linear
(backend make_linear), so the bfloat16 activations of the packed CPU kernels are measured too.
The same modules assemble the verification models (quant_auto.py).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn
from tqdm import tqdm

from tritium.backend.config import LayerQuant
from tritium.backend.models.linear import make_linear
from tritium.kernels import ops

from .. import calibration as calib
from .awq import awq_search_scale, pooled_head_stat
from .quant_layers import LINEARS, quantize_weight
from .quant_pipeline import _collect_layer_inputs
from .quantize_int8 import quantize_int8

# Candidate kinds a user may allow (--auto-candidates). A new format (e.g. group-wise int8) is
# one more kind here and one more branch in candidate_layer_quants.
AUTO_KINDS = ("int4", "int8", "none")
INT4_GROUP_SIZES = (32, 64, 128)   # per-layer int4 group sizes tried (plus the source grid)
AUTO_INT4_METHODS = ("int4-rtn", "int4-awq", "int4-gptq")
SENSITIVITY_SAMPLES = 2            # calibration windows (of 128 tokens) the KL is measured on


def head_names(m) -> Tuple[str, ...]:
    """The embedding / LM head entries of an int4-style build ('embed_tokens', + 'lm_head' if untied)."""
    return ("embed_tokens",) + (() if m.tie_word_embeddings else ("lm_head",))


def candidate_layer_quants(cfg, kinds, int4_plans: Dict[int, dict], excluded) -> Dict[str, Dict[str, LayerQuant]]:
    """{linear name: {candidate name: LayerQuant}} over every linear and the embedding / head.

    int4_plans: {group size: the int4 plan (quant_plan.plan_layers) for that group size}; key 0 is
    the default plan (the GGUF source grid where there is one). excluded(name) -> keep float."""
    m = cfg.model
    out: Dict[str, Dict[str, LayerQuant]] = {}
    for i in range(m.num_layers):
        for lin in LINEARS:
            name = f"layers.{i}.{lin}"
            c: Dict[str, LayerQuant] = {}
            if not excluded(name):
                if "int4" in kinds:
                    for _, plan in sorted(int4_plans.items()):  # the source-grid plan (key 0) first
                        lq = plan[name]
                        c.setdefault(f"int4-g{lq.group_size}", lq)
                if "int8" in kinds:
                    c["int8"] = LayerQuant("int8")
            if "none" in kinds or not c:
                c["none"] = LayerQuant("none")
            out[name] = c
    for name in head_names(m):
        # like int4 builds: the embedding / LM head as per-row int8, or float when it must
        c = {"int8": LayerQuant("int8")} if (set(kinds) & {"int4", "int8"}) and not excluded(name) else {}
        if "none" in kinds or not c:
            c["none"] = LayerQuant("none")
        out[name] = c
    return out


def _nbytes(tensors: dict) -> int:
    return int(sum(t.numel() * t.element_size() for t in tensors.values()))


class InputScaled(nn.Module):
    """AWQ in isolation: y = (x / s) Q^T for Q quantized from W s; the build folds 1 / s into
    the preceding op instead (the same function)."""

    def __init__(self, inner: nn.Module, s: torch.Tensor):
        super().__init__()
        self.inner, self.s = inner, s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner((x.float() / self.s).to(x.dtype))


def runtime_linear(lq: LayerQuant, tensors: dict, like: nn.Module, dtype: torch.dtype) -> nn.Module:
    """The runtime's own linear (backend make_linear) for `lq`, holding the engine `tensors`,
    with the bias of `like` (so the measurement includes the runtime kernels' own rounding)."""
    bias = getattr(like, "bias", None)
    mod = make_linear(like.in_features, like.out_features, bias is not None, dtype, lq)
    for leaf, t in tensors.items():
        cur = mod._buffers[leaf]
        mod._buffers[leaf] = t.to(cur.dtype if cur is not None else t.dtype)
    if bias is not None:
        mod._buffers["bias"] = bias
    return mod


def quantized_linear(m, lin: str, like: nn.Module, lq: LayerQuant, int4_method: str,
                     stats: Optional[dict], dtype: torch.dtype) -> Tuple[int, nn.Module]:
    """(stored bytes, runtime module) of one decoder linear `like` (a float DenseLinear) in `lq`'s
    format, rounded as the build rounds it."""
    w = like.weight.float()
    if lq.method == "int4" and int4_method == "int4-awq":
        st = stats[lin]
        stat = st["mean_abs"]
        if lin == "o_proj":  # one scale per KV group: it folds into the v rows of qkv
            stat = pooled_head_stat(stat, m.num_heads, m.num_kv_heads, m.head_dim)
        s, _, _ = awq_search_scale([w], st["x"], stat, lq.group_size)
        tensors, _ = quantize_weight(w * s, lq, "int4-rtn", None)
        return _nbytes(tensors), InputScaled(runtime_linear(lq, tensors, like, dtype), s)
    tensors, _ = quantize_weight(w, lq, int4_method, stats.get(lin) if stats else None)
    return _nbytes(tensors), runtime_linear(lq, tensors, like, dtype)


def quantized_head(weight: torch.Tensor, lq: LayerQuant, dtype: torch.dtype) -> Tuple[int, nn.Module]:
    """(bytes, runtime Int8Linear) of the embedding / LM head as per-row int8 (round to nearest)."""
    q, s = quantize_int8(weight.float())
    vocab, hidden = weight.shape
    like = nn.Module()
    like.in_features, like.out_features, like.bias = hidden, vocab, None
    tensors = {"qweight": q, "scales": s}
    return _nbytes(tensors), runtime_linear(lq, tensors, like, dtype)


def swap_module(model, name: str, module: Optional[nn.Module]) -> Callable[[], None]:
    """Put `module` (None: keep the float one) in place of linear `name` ('layers.3.o_proj',
    'lm_head', or 'embed_tokens': the lookup and, when tied, the head) of a float DecoderLM;
    returns the function that puts the float one back."""
    if module is None:
        return lambda: None
    if name == "embed_tokens":
        old = model.embed_tokens_weight
        model.embed_tokens = module
        model._buffers["embed_tokens_weight"] = None

        def restore():
            model.embed_tokens = None
            model._buffers["embed_tokens_weight"] = old
        return restore
    if name == "lm_head":
        parent, attr = model, "lm_head"
    else:
        i, attr = name.split(".")[1:]
        parent = model.layers[int(i)]
    old = getattr(parent, attr)
    setattr(parent, attr, module)
    return lambda: setattr(parent, attr, old)


@torch.no_grad()
def tail_log_probs(model, runner, start: int) -> torch.Tensor:
    """Log-probs (tokens, vocab) of the runner's samples, running layers start..L-1 from the
    runner's cached inputs of layer `start` (nothing in the runner is changed)."""
    hs, rs = list(runner.hidden), list(runner.residual)
    for j in range(start, len(model.layers)):
        layer = model.layers[j]
        for c, meta in enumerate(runner.metas):
            shape = (runner.num_blocks[c], runner.block_size) + runner.kv_shape
            kv = (torch.zeros(shape, dtype=hs[c].dtype), torch.zeros(shape, dtype=hs[c].dtype))
            hs[c], rs[c] = layer(runner.positions[c], hs[c], rs[c], kv, meta, model.rope_state(runner.positions[c]))
    out = []
    for h, r in zip(hs, rs):
        x, _ = ops.rms_norm(h, model.norm_weight, model.cfg.model.rms_norm_eps, r)
        out.append(torch.log_softmax(model.compute_logits(x).float(), dim=-1))
    return torch.cat(out)


def mean_kl(ref_lp: torch.Tensor, lp: torch.Tensor) -> float:
    """Mean over tokens of KL(ref || model) from log-probs (tokens, vocab); >= 0."""
    return max(0.0, float((ref_lp.exp() * (ref_lp - lp)).sum(-1).mean()))


@torch.no_grad()
def measure_sensitivities(model, candidates: Dict[str, Dict[str, LayerQuant]], int4_method: str,
                          samples: List[List[int]], calib_runner=None, progress: bool = True
                          ) -> Tuple[Dict[str, Dict[str, Tuple[int, float]]], Dict[Tuple[str, str], nn.Module]]:
    """Measure every (linear, candidate) of a float DecoderLM.

    samples: token windows the KL is measured on. calib_runner: a LayerwiseRunner over the
    calibration set, for GPTQ's Hessians / AWQ's statistics (None for int4-rtn).
    Returns ({name: {candidate: (bytes, mean KL)}}, {(name, candidate): runtime module}); float
    candidates have no module (swap_module(None) keeps the float one)."""
    m = model.cfg.model
    dtype = model.norm_weight.dtype
    runner = calib.LayerwiseRunner(model, samples)
    ref_lp = tail_log_probs(model, runner, 0)
    measured: Dict[str, Dict[str, Tuple[int, float]]] = {}
    modules: Dict[Tuple[str, str], nn.Module] = {}
    total = sum(len(c) for c in candidates.values())
    bar = tqdm(total=total, desc=f"sensitivity ({int4_method} for int4)", unit="candidate", disable=not progress)

    def measure(name, float_bytes, make, run):
        measured[name] = {}
        for cand, lq in candidates[name].items():
            if lq.method == "none":
                measured[name][cand] = (float_bytes, 0.0)
            else:
                nbytes, modules[(name, cand)] = make(lq)
                restore = swap_module(model, name, modules[(name, cand)])
                try:
                    measured[name][cand] = (nbytes, mean_kl(ref_lp, run()))
                finally:
                    restore()
            bar.update()

    for i in range(m.num_layers):
        stats = None
        if calib_runner is not None:
            stats = _collect_layer_inputs(calib_runner, i, int4_method)
            calib_runner.run_layer(i, advance=True)
        for lin in LINEARS:
            like = getattr(model.layers[i], lin)
            measure(f"layers.{i}.{lin}", like.weight.numel() * like.weight.element_size(),
                    lambda lq, lin=lin, like=like: quantized_linear(m, lin, like, lq, int4_method, stats, dtype),
                    lambda i=i: tail_log_probs(model, runner, i))
        runner.run_layer(i, advance=True)
    for name in head_names(m):
        w = model.embed_tokens_weight if name == "embed_tokens" else model.lm_head.weight
        if name == "lm_head":  # only the head changes: run from the final hidden states
            def run():
                return tail_log_probs(model, runner, m.num_layers)
        else:  # the lookup changes (and the head, when tied): run the whole model again
            start = calib.LayerwiseRunner(model, samples)

            def run(start=start):
                start.hidden = [model.embed(torch.tensor([t for s in seqs for t in s])) for seqs in start.chunks]
                return tail_log_probs(model, start, 0)
        measure(name, w.numel() * w.element_size(), lambda lq, w=w: quantized_head(w, lq, dtype), run)
    bar.close()
    return measured, modules
