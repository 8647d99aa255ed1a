"""Helpers for tensor-parallel tests: step logits, worker processes, clean-up checks."""
from __future__ import annotations

import os
import time
from typing import List

import pytest

TEST_TIMEOUT_S = "120"  # collective timeout in tests: no hung collective outlives a test for long


@pytest.fixture(scope="module")
def tp_timeout():
    old = os.environ.get("TRITIUM_TP_TIMEOUT_S")
    os.environ["TRITIUM_TP_TIMEOUT_S"] = TEST_TIMEOUT_S
    yield
    if old is None:
        os.environ.pop("TRITIUM_TP_TIMEOUT_S", None)
    else:
        os.environ["TRITIUM_TP_TIMEOUT_S"] = old


def record_logits(engine) -> List:
    """Wrap engine.runner.run so every step's logits are kept (the real run still does the work)."""
    seen = []
    real = engine.runner.run

    def run(sched):
        out = real(sched)
        seen.append(out.clone())
        return out
    engine.runner.run = run
    return seen


def processes_with(needle: str) -> List[int]:
    """PIDs whose command line contains `needle` (e.g. a unique engine path), not counting zombies."""
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{d}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in cmd and "tritium.backend.parallel.worker" in cmd and state != "Z":
            pids.append(int(d))
    return pids


def wait_no_workers(needle: str, timeout: float = 20.0) -> List[int]:
    """Wait until no worker of `needle` runs; returns those still running at the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        left = processes_with(needle)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def assert_vocab_shards(full_dir: str, tp_dir: str, dequantize) -> None:
    """A tensor-parallel engine's ranks hold the embedding's vocabulary rows of the one-rank
    engine: dequantize(tensors) of each rank equals the full engine's rows [v0, v1) of its layout,
    and the scales are split by column (vocabulary) with their group rows whole."""
    import json

    import torch
    from safetensors.torch import load_file
    full = load_file(os.path.join(full_dir, "rank0.safetensors"))
    deq = dequantize(full)
    with open(os.path.join(tp_dir, "engine.json")) as f:
        ranks = json.load(f)["tensor_parallel"]["ranks"]
    assert len(ranks) >= 2
    for r, rank in enumerate(ranks):
        t = load_file(os.path.join(tp_dir, f"rank{r}.safetensors"))
        v0, v1 = rank["vocab"]
        assert t["embed_tokens.scales"].shape == (full["embed_tokens.scales"].shape[0], v1 - v0)
        assert torch.equal(dequantize(t), deq[v0:v1])


def assert_tp2_equals_tp1(make_engine, check_tp2=None) -> None:
    """Greedy tokens and every step's logits (1e-4 relative) of the engine built with
    tensor_parallel_size 2 equal those of the one-rank build, on two prompts; no worker outlives
    close(). make_engine(**kw) builds (or returns the cached) float32 engine; check_tp2(path)
    inspects the 2-rank engine's files."""
    from hf_oracle import PROMPTS, rel_err
    from tritium.backend.engine import LLMEngine
    from tritium.backend.sampling_params import SamplingParams
    prompts = [PROMPTS[0], PROMPTS[1]]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    runs = []
    for tp in (1, 2):
        path = make_engine(**({"tensor_parallel_size": 2} if tp == 2 else {}))
        kw = {"threads_per_rank": 1} if tp == 2 else {}
        with LLMEngine(path, device="cpu", num_kv_blocks=64, **kw) as e:
            logs = record_logits(e)
            outs = e.generate(prompt_token_ids=prompts, params=greedy)
            runs.append(([o.outputs[0].token_ids for o in outs], logs))
        if tp == 2:
            assert not wait_no_workers(path), "a worker outlived close()"
            if check_tp2 is not None:
                check_tp2(path)
    (tok1, log1), (tok2, log2) = runs
    assert tok2 == tok1
    assert len(log2) == len(log1) and all(rel_err(a, b) < 1e-4 for a, b in zip(log2, log1))
