"""SmolLM2-135M-Instruct (the real default model, from its GGUF) against HF's own GGUF load."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tritium.backend.loader import load_engine
from simple_generate import generate_simple, prompt_logits

pytestmark = pytest.mark.slow

TEXT_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def hf_greedy(hf, ids, n):
    out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                      attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


def test_smollm2_fp32_logits_and_greedy_match_hf(smollm2_engine, smollm2_hf):
    cfg, model, tok = load_engine(smollm2_engine("float32"), "cpu")
    assert (cfg.model.num_layers, cfg.model.num_heads, cfg.model.num_kv_heads) == (30, 9, 3)
    for text in TEXT_PROMPTS:
        ids = tok.encode(text).ids
        with torch.no_grad():
            ref = smollm2_hf(torch.tensor([ids])).logits[0]
        assert rel_err(prompt_logits(model, ids), ref) < 1e-4
        ours, _ = generate_simple(model, ids, 32, eos_token_ids=cfg.model.eos_token_ids)
        assert ours == hf_greedy(smollm2_hf, ids, 32), text


def test_smollm2_bf16_within_tolerance(smollm2_engine, smollm2_hf):
    """bf16: 3e-2 relative logits error and >= 90% top-1 agreement (see test_engine_numerics)."""
    _, model, tok = load_engine(smollm2_engine("bfloat16"), "cpu")
    ids = tok.encode(" ".join(TEXT_PROMPTS)).ids
    with torch.no_grad():
        ref = smollm2_hf(torch.tensor([ids])).logits[0]
    ours = prompt_logits(model, ids)
    assert rel_err(ours, ref) < 3e-2
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.9


def test_smollm2_tokenizer_matches_hf(smollm2_engine, smollm2_gguf):
    import os

    from transformers import AutoTokenizer
    hf_tok = AutoTokenizer.from_pretrained(os.path.dirname(smollm2_gguf), gguf_file=os.path.basename(smollm2_gguf))
    _, _, tok = load_engine(smollm2_engine("float32"), "cpu")
    for text in TEXT_PROMPTS + ["Zürich café 東京 🙂 <|im_start|>user\nhi<|im_end|>"]:
        assert tok.encode(text).ids == hf_tok(text).input_ids


def test_cli_build_then_generate_matches_hf(smollm2_gguf, smollm2_hf, tmp_path):
    """`tritium build` on the GGUF then `tritium generate --json` gives HF's greedy tokens."""
    engine = tmp_path / "engine"
    cli = [sys.executable, "-m", "tritium.client.cli"]
    r = subprocess.run(cli + ["build", smollm2_gguf, "-o", str(engine), "--dtype", "float32", "--quiet"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    report = json.loads((engine / "build_report.json").read_text())
    assert report["parameters"] > 100_000_000 and len(report["source_sha256"]) == 64
    prompt = "The capital of France is"
    r = subprocess.run(cli + ["generate", "--engine", str(engine), prompt, "--max-tokens", "24", "--json"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(out) >= {"text", "token_ids", "prompt_token_ids", "finish_reason"}
    assert out["token_ids"] == hf_greedy(smollm2_hf, out["prompt_token_ids"], 24)
    assert "Paris" in out["text"] and prompt not in out["text"]
    r2 = subprocess.run(cli + ["generate", "--engine", str(engine), "--prompt-ids",
                               ",".join(map(str, out["prompt_token_ids"])), "--max-tokens", "24", "--json"],
                        capture_output=True, text=True)
    assert json.loads(r2.stdout.strip().splitlines()[-1])["token_ids"] == out["token_ids"]
