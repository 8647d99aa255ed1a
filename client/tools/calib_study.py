"""Held-out figures for calibration choices, scored in one process against one float reference
(its log-probs computed once per domain): the figures in docs/quantization.md's calibration
section come from here.

    python -m tritium.client.tools.calib_study --float-engine F32_ENGINE --source GGUF --part head|kv|engines \
        [--engines DIR ...] [--num-tokens kjv=8192,devil=2048] --out results.jsonl

- head:    int4-rtn / int4-awq / int4-gptq, each with its LM head centred and not (the decoder
           layers are quantized once per method; only the head differs between the two);
- kv:      fp8 / int8 KV caches: the default mix against the former docstring calibration;
- kv-attention: fp8 / int8 KV caches with attention-weighted offsets (kv_scales.py);
- engines: already-built engine folders (e.g. `tritium build` outputs), for cross-checks.
Every variant is scored on each held-out domain (kjv, devil) over its --num-tokens tokens with
quant_eval.evaluate, the function behind `tritium eval`, and appended to --out as one JSON line.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import torch
from safetensors.torch import load_file, save_file

from tritium.backend.config import EngineConfig, QuantConfig
from tritium.backend.loader import load_engine
from tritium.backend.models.decoder import DecoderLM
from tritium.kernels.quant_layouts import INT4_LAYOUT, INT8_LAYOUT

from tritium.builder.quant import kv_scales
from tritium.builder.calibration_mix import HELD_OUT_DOMAINS, domain_text
from tritium.builder.quant.quant_eval import encode_text, evaluate
from tritium.builder.quant.quant_head import quantize_embeddings
from tritium.builder.quant.quant_pipeline import (CALIBRATED, QuantOptions, _calibration_runner, _float_model,
                                                  plan_layers, _quantize_layers, quantize_engine_weights)


class Scorer:
    """Scores models on the held-out domains against the float reference (cached log-probs)."""

    def __init__(self, float_engine: str, num_tokens: dict, out: str, ref_dir=None):
        self.cfg, self.reference, self.tokenizer = load_engine(float_engine, "cpu")
        self.tensors = load_file(os.path.join(float_engine, "rank0.safetensors"))
        self.ids = {d: encode_text(self.tokenizer, domain_text(d), num_tokens[d]) for d in HELD_OUT_DOMAINS}
        self.cache = {d: {} for d in HELD_OUT_DOMAINS}
        self.out = out
        self.ref_dir = ref_dir

    def _reference_log_probs(self) -> None:
        """Fill self.cache with the reference's log-probs: computed here, or read from ref_dir
        where another study process wrote them (it holds ref_dir/computing meanwhile)."""
        if self.ref_dir is None or all(self.cache.values()):
            return
        os.makedirs(self.ref_dir, exist_ok=True)
        lock, done = os.path.join(self.ref_dir, "computing"), os.path.join(self.ref_dir, "done")
        while os.path.exists(lock) and not os.path.exists(done):
            time.sleep(10)
        if os.path.exists(done):
            for d in HELD_OUT_DOMAINS:
                t = load_file(os.path.join(self.ref_dir, f"{d}.safetensors"))
                self.cache[d] = {(int(k.split("_")[1]), tuple(w)): t[k] for k in t if k.startswith("window_")
                                 for w in [windows_of(self, d)[int(k.split("_")[1])]]}
            return
        open(lock, "w").close()
        for d in HELD_OUT_DOMAINS:
            evaluate(self.reference, self.ids[d], reference=self.reference, reference_cache=self.cache[d])
            save_file({f"window_{i}": v.contiguous() for (i, _), v in self.cache[d].items()},
                      os.path.join(self.ref_dir, f"{d}.safetensors"))
        open(done, "w").close()

    def score(self, name: str, model, **info) -> None:
        self._reference_log_probs()
        row = {"variant": name, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), **info}
        for d in HELD_OUT_DOMAINS:
            r = evaluate(model, self.ids[d], reference=self.reference, reference_cache=self.cache[d])
            row[d] = {k: r[k] for k in ("perplexity", "reference_perplexity", "perplexity_increase",
                                        "mean_kl", "top1_agreement", "tokens")}
        with open(self.out, "a") as f:
            f.write(json.dumps(row, sort_keys=True) + "\n")
        print(json.dumps(row, sort_keys=True), flush=True)

    def model_of(self, tensors: dict, quantization: QuantConfig, kv_cache=None) -> DecoderLM:
        cfg = dataclasses.replace(self.cfg, quantization=quantization, kv_cache=kv_cache or self.cfg.kv_cache)
        m = DecoderLM(cfg)
        m.load_engine_weights(tensors)
        return m.eval()


def windows_of(s: "Scorer", domain: str):
    from tritium.builder.quant.quant_eval import windows
    return windows(s.ids[domain], min(s.cfg.limits.max_seq_len, s.reference.cfg.limits.max_seq_len))


def run_head(s: Scorer, source: str, methods, calibration_text=None) -> None:
    tied = s.cfg.model.tie_word_embeddings
    for method in methods:
        o = QuantOptions.of(quantization=method, source=source, head_centring=True, progress=True,
                            calibration_text=calibration_text, eval_tokens=0)
        plan = plan_layers(s.cfg, o)
        model = _float_model(s.cfg, s.tensors)
        runner, info = _calibration_runner(model, s.tokenizer, o)
        new = dict(s.tensors)
        _, _, head_stats = _quantize_layers(s.cfg, model, new, plan, o, runner, method in CALIBRATED, "none")
        del runner, model
        for centre in (False, True):
            n2, p2 = dict(new), dict(plan)
            rep = quantize_embeddings(n2, p2, method, tied, head_stats, centre=centre)
            used = {lq.method for lq in p2.values()}
            layouts = {k: v for k, v in {"int4": INT4_LAYOUT, "int8": INT8_LAYOUT}.items() if k in used}
            qcfg = QuantConfig(method=method, group_size=o.group_size, layers=p2, layouts=layouts)
            head = "embed_tokens" if tied else "lm_head"
            s.score(f"{method} head {'centred' if centre else 'uncentred'}", s.model_of(n2, qcfg),
                    calibration=info["source"], head=rep.get(head, {}))


def run_kv(s: Scorer, source: str, variants) -> None:
    for name, kw, headroom in variants:
        kv_scales.FP8_HEADROOM = headroom  # study only: the FP8 scale's headroom over the amax
        new, qcfg, kvcfg, _ = quantize_engine_weights(s.cfg, s.tensors, source=source, eval_tokens=0,
                                                      progress=False, tokenizer=s.tokenizer, **kw)
        s.score(name, s.model_of(new, qcfg, kvcfg), calibration=qcfg.calibration.get("source"),
                kv_rotation=kvcfg.rotation, fp8_headroom=headroom)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--float-engine", required=True)
    ap.add_argument("--source", required=True, help="the GGUF / checkpoint the float engine was built from")
    ap.add_argument("--part", required=True, choices=("head", "kv", "kv-attention", "kv-offsets", "engines"))
    ap.add_argument("--engines", nargs="*", default=[])
    ap.add_argument("--methods", default="int4-rtn,int4-awq,int4-gptq")
    ap.add_argument("--docstrings", default=None, help="the former default calibration text as a file")
    ap.add_argument("--num-tokens", default="kjv=8192,devil=2048", help="tokens per held-out domain")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True)
    ap.add_argument("--ref-dir", default=None, help="share the reference's log-probs between study processes")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tokens = {k: int(v) for k, v in (kv.split("=") for kv in args.num_tokens.split(","))}
    s = Scorer(args.float_engine, tokens, args.out, args.ref_dir)
    if args.part == "head":
        run_head(s, args.source, args.methods.split(","))
        score_engines(s, args.engines)
    elif args.part == "kv":
        doc = {"calibration_text": args.docstrings} if args.docstrings else None
        variants = [("kv fp8 mix", dict(kv_cache_dtype="fp8"), 2.0),
                    ("kv fp8 mix attention offsets", dict(kv_cache_dtype="fp8", kv_offsets="attention"), 2.0)]
        if doc:
            variants += [("kv fp8 docstrings", dict(kv_cache_dtype="fp8", **doc), 2.0)]
        variants += [("kv int8 mix", dict(kv_cache_dtype="int8"), 2.0)]
        if doc:
            variants += [("kv int8 docstrings", dict(kv_cache_dtype="int8", **doc), 2.0)]
        run_kv(s, args.source, variants)
        score_engines(s, args.engines)
    elif args.part == "kv-attention":
        run_kv(s, args.source, [("kv fp8 mix attention offsets", dict(kv_cache_dtype="fp8", kv_offsets="attention"), 2.0),
                                ("kv int8 mix attention offsets", dict(kv_cache_dtype="int8", kv_offsets="attention"), 2.0)])
    elif args.part == "kv-offsets":
        run_kv(s, args.source, [(f"kv {dt} mix {off} offsets", dict(kv_cache_dtype=dt, kv_offsets=off), 2.0)
                                for dt in ("fp8", "int8") for off in ("mean", "none")])
    else:
        score_engines(s, args.engines)


def score_engines(s: Scorer, engines) -> None:
    for e in engines:
        cfg = EngineConfig.load(e)
        _, model, _ = load_engine(e, "cpu")
        s.score(f"engine {e}", model, calibration=cfg.quantization.calibration.get("source"))


if __name__ == "__main__":
    main()
