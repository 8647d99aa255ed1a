"""Per-expert calibration of a sparse MoE layer: one GPTQ Hessian per expert and projection, from
the calibration tokens the router sends to that expert.

GPTQ (Frantar et al., "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers", 2022) minimises ||W X - Q X|| over a layer's calibration inputs X; an expert only
ever sees the tokens routed to it, so its X is those tokens (gate_up: the hidden states; down:
act(gate_up) of the same tokens, from the float expert). A forward pre-hook on the layer's router
routes each calibration chunk exactly as the layer does (SparseMoE.select_experts).

Experts that few calibration tokens reach: an expert with fewer than `min_tokens` routed tokens
(min(hidden_size, 256): enough rows for a full-rank Hessian on small models, bounded on large
ones) has its Hessian augmented with the tokens that the router ranks highest for it among those
not routed to it (the router's next choices: highest softmax probability, or sigmoid score for
DeepSeek's routers), up to min_tokens in all. Only when the calibration set has no such tokens
either (fewer calibration tokens than min_tokens) does the expert fall back to round-to-nearest.
The report counts routed tokens per expert and the experts augmented or rounded.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

from .gptq import HessianAccumulator

MAX_MIN_TOKENS = 256


class _Hessian:
    """The object quant_layers.quantize_weight reads: stats['H'].hessian()."""

    def __init__(self, h: torch.Tensor):
        self.h = h

    def hessian(self) -> torch.Tensor:
        return self.h


class ExpertHessians:
    """Accumulates, over calibration chunks, per-expert Hessians of a SparseMoE layer's experts."""

    def __init__(self, layer, min_tokens: Optional[int] = None):
        w13 = layer.experts.gate_up_weight
        self.layer = layer
        self.num_experts, two_i, self.hidden = w13.shape
        self.min_tokens = min(self.hidden, MAX_MIN_TOKENS) if min_tokens is None else min_tokens
        self.gate_up = [HessianAccumulator(self.hidden) for _ in range(self.num_experts)]
        self.down = [HessianAccumulator(two_i // 2) for _ in range(self.num_experts)]
        self.counts = torch.zeros(self.num_experts, dtype=torch.int64)
        # the best not-routed candidates per expert: router score and hidden row
        self.cand_score = torch.full((self.num_experts, 0), float("-inf"))
        self.cand_rows = torch.zeros(self.num_experts, 0, self.hidden)

    def hook(self):
        """Register the router pre-hook; returns its handle."""
        def pre(_m, args):
            if not self._inside:  # add() calls the router itself
                self._inside = True
                try:
                    self.add(args[0])
                finally:
                    self._inside = False
        return self.layer.router.register_forward_pre_hook(pre)

    _inside = False

    def _down_input(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        w13 = self.layer.experts.gate_up_weight[e].float()
        return self.layer.act_mul(F.linear(rows, w13)).float()

    @torch.no_grad()
    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1])
        _, ids, scores = self.layer.select_experts(x)
        xf = x.float()
        routed = torch.zeros(x.shape[0], self.num_experts, dtype=torch.bool)
        routed.scatter_(1, ids.cpu(), True)
        self.counts += routed.sum(0)
        for e in ids.unique().tolist():
            rows = xf[routed[:, e]]
            self.gate_up[e].add(rows)
            self.down[e].add(self._down_input(e, rows))
        # keep the min_tokens best-scored tokens not routed to each expert (the router's next choices)
        s = scores.float().cpu().t().masked_fill(routed.t(), float("-inf"))  # (E, T)
        all_s = torch.cat([self.cand_score, s], 1)
        keep = min(self.min_tokens, all_s.shape[1])
        top_s, top_i = torch.topk(all_s, keep, dim=1)
        src = torch.cat([self.cand_rows, xf.cpu().unsqueeze(0).expand(self.num_experts, -1, -1)], 1)
        self.cand_rows = torch.gather(src, 1, top_i.unsqueeze(-1).expand(-1, -1, self.hidden))
        self.cand_score = top_s

    def finish(self) -> Dict[str, object]:
        """Augment the experts below min_tokens; returns {"gate_up": [H_e or None], "down": [...],
        "report": {...}}. None: no calibration tokens at all for that expert (RTN fallback)."""
        out: Dict[str, List] = {"gate_up": [], "down": []}
        augmented, rtn = [], []
        for e in range(self.num_experts):
            n = int(self.counts[e])
            if n < self.min_tokens:
                valid = torch.isfinite(self.cand_score[e])
                extra = self.cand_rows[e][valid][: self.min_tokens - n]
                if extra.shape[0]:
                    self.gate_up[e].add(extra)
                    self.down[e].add(self._down_input(e, extra))
                    augmented.append(e)
            if self.gate_up[e].count == 0:
                rtn.append(e)
                out["gate_up"].append(None)
                out["down"].append(None)
                continue
            out["gate_up"].append(_Hessian(self.gate_up[e].hessian()))
            out["down"].append(_Hessian(self.down[e].hessian()))
        c = self.counts.tolist()
        out["report"] = {"routed_tokens_per_expert": c, "min_tokens": self.min_tokens,
                         "experts_below_min_tokens": sum(1 for n in c if n < self.min_tokens),
                         "experts_without_tokens": sum(1 for n in c if n == 0),
                         "experts_augmented": augmented, "experts_round_to_nearest": rtn}
        return out
