"""Packed weights on 2 MiB pages (kernels/hugepages.py, native_step.weights_to_huge_pages): the
copies hold the same values where they should (one buffer, 2 MiB aligned, advised), the switch
and its errors, and a W8A8 / W4A8 / bf16 engine whose weights moved computes the same bits as
before the move: its LM head (logits) and the per-op and native decode steps, on every CPU path
(ids name it), with the AVX-512 kernels' huge-page prefetch distance in force. And the per-op profile of the
native step (client/bench/step_profile.py, TRITIUM_STEP_PROFILE) prints every op.

Oracle: the same engine's outputs before the move (values only move in memory), whose kernels are
tested against the torch references in test_kernels_i8dot.py / test_head_int6.py.
"""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from tritium.backend.engine import LLMEngine
from tritium.backend.models import native_step
from tritium.kernels import cpu_native, hugepages

from test_native_step import SHAPES, _steps

pytestmark = pytest.mark.usefixtures("one_thread")

WEIGHTS = {"w8a8": dict(quantization="int8", group_size=32, activation_quant="int8", smoothquant=False),
           "w4a8": dict(quantization="int4-rtn", group_size=32, activation_quant="int8", smoothquant=False),
           "bf16": dict(deterministic=True)}


def test_copies_in_one_aligned_buffer(monkeypatch):
    monkeypatch.delenv(hugepages.ENV, raising=False)
    gen = torch.Generator().manual_seed(0)
    ts = [torch.randint(0, 255, (3, 5, 7), generator=gen, dtype=torch.uint8),
          torch.randn(33, generator=gen).half(), torch.randn(4, 9, generator=gen).t(),  # not contiguous
          torch.randn(2, 3, generator=gen).bfloat16()]
    out = hugepages.to_huge_pages(ts)
    assert out is not None, "Linux: madvise(MADV_HUGEPAGE) must be accepted"
    base = out[0].data_ptr()
    assert base % hugepages.HUGE == 0
    for a, b in zip(ts, out):
        assert b.dtype == a.dtype and b.shape == a.shape and b.is_contiguous() and torch.equal(a, b)
        assert b.data_ptr() % hugepages.ALIGN == 0
        assert b.untyped_storage().data_ptr() == out[0].untyped_storage().data_ptr()  # one buffer
    ends = [b.data_ptr() + b.numel() * b.element_size() for b in out]
    assert all(e <= s for e, s in zip(ends, [b.data_ptr() for b in out[1:]]))  # in order, no overlap


def test_thp_never_moves_nothing(monkeypatch):
    assert hugepages.thp_mode() in ("always", "madvise", "never", None)
    monkeypatch.setattr(hugepages, "thp_mode", lambda: "never")
    assert hugepages.to_huge_pages([torch.ones(4)]) is None


def test_switch_and_errors(monkeypatch):
    t = [torch.ones(4)]
    monkeypatch.setenv(hugepages.ENV, "0")
    assert hugepages.to_huge_pages(t) is None
    monkeypatch.setenv(hugepages.ENV, "maybe")
    with pytest.raises(ValueError, match="TRITIUM_HUGE_PAGES.*allowed: 1"):
        hugepages.to_huge_pages(t)
    monkeypatch.setenv(hugepages.ENV, "1")
    assert hugepages.to_huge_pages([]) is None
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="CPU tensors only"):
            hugepages.to_huge_pages([torch.ones(2, device="cuda")])


@pytest.fixture(scope="module")
def engine_dir(tiny_checkpoint, tmp_path_factory):
    from tritium.builder.build import BuildOptions, build_engine
    cache = {}

    def make(weights: str):
        if weights not in cache:
            family, over = SHAPES["llama-gqa"]
            out = str(tmp_path_factory.mktemp(f"huge-{weights}") / "engine")
            build_engine(BuildOptions(source=tiny_checkpoint(family, **over), output=out, dtype="bfloat16",
                                      progress=False, block_size=4, **WEIGHTS[weights]))
            cache[weights] = out
        return cache[weights]
    return make


@pytest.mark.parametrize("weights", ["w8a8", "w4a8", "bf16"])
def test_engine_same_bits_after_the_move(engine_dir, weights, cpu_path, monkeypatch):
    monkeypatch.delenv(hugepages.ENV, raising=False)
    eng = LLMEngine(engine_dir(weights), num_kv_blocks=8, enable_prefix_caching=False)
    model = eng.runner.model
    fields = native_step._streamed_weights(model)
    # every layer linear (i8dot: codes, d, r and z where asymmetric), and the head
    assert len(fields) >= (3 if weights != "bf16" else 1) * 4 * len(model.layers) + 1, len(fields)
    before = [native_step._get(h, f).clone() for h, f in fields]
    ptrs = [native_step._get(h, f).data_ptr() for h, f in fields]
    old_refs = [weakref.ref(native_step._get(h, f)) for h, f in fields]
    h = torch.randn(3, model.cfg.model.hidden_size, generator=torch.Generator().manual_seed(5)).bfloat16()
    logits_before = model.compute_logits(h)
    monkeypatch.setenv(native_step.ENV, "0")
    ref = _steps(model, seed=4)  # the per-op path; builds the NativeStep, which moves the weights
    step = native_step.NativeStep.get(model)
    assert step is not None and step.huge_page_bytes > 0
    base = native_step._get(*fields[0]).data_ptr()
    assert base % hugepages.HUGE == 0
    for (holder, f), old, ptr in zip(fields, before, ptrs):
        now = native_step._get(holder, f)
        assert torch.equal(now, old) and now.data_ptr() != ptr, (cpu_path, f)  # moved, same values
        assert base <= now.data_ptr() < base + step.huge_page_bytes + hugepages.ALIGN * len(fields)
    gc.collect()
    assert all(r() is None for r in old_refs), "the moved weights' old tensors are still held"
    assert torch.equal(model.compute_logits(h), logits_before), cpu_path
    monkeypatch.setenv(native_step.ENV, "1")
    got = _steps(model, seed=4)
    for i, (a, b) in enumerate(zip(ref[0], got[0])):
        assert torch.equal(a, b), (cpu_path, weights, i)


def test_prefetch_distance_changes_no_bits(cpu_path):
    """The AVX-512 kernel asks 2 KB ahead instead of 8 KB on huge pages: same results."""
    from tritium.kernels import i8dot_pack as ip
    gen = torch.Generator().manual_seed(7)
    codes = torch.randint(-128, 128, (80, 96), generator=gen)
    w = ip.repack(codes, torch.rand(3, 80, generator=gen) / 40 + 1e-3, torch.randn(3, 80, generator=gen) / 50, 32, 8)
    x = torch.randn(5, 96, generator=gen).bfloat16()
    lib = cpu_native._lib()
    lib.tritium_i8dot_huge_pages(0)
    a = cpu_native.i8dot_gemm(x, w)
    lib.tritium_i8dot_huge_pages(1)
    try:
        b = cpu_native.i8dot_gemm(x, w)
    finally:
        lib.tritium_i8dot_huge_pages(0)
    assert torch.equal(a, b), cpu_path


def test_step_profile_prints_every_op(engine_dir, capsys, monkeypatch):
    from tritium.client.bench import step_profile
    from tritium.kernels.decode_layer import PROFILE_OPS
    monkeypatch.delenv(step_profile.ENV, raising=False)
    assert step_profile.main([engine_dir("w8a8"), "--tokens", "4", "--rounds", "1", "--bandwidth-gbs", "10"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {ln[:22].strip(): ln[22:].split() for ln in lines[2:-1]}
    assert set(rows) == set(PROFILE_OPS) | {"lookup and final norm", "head", "python and sampling", "step"}, lines
    for op in ("qkv", "o", "gate_up", "down", "attention", "lookup and final norm", "head", "step"):
        assert float(rows[op][0]) > 0, (op, lines)  # the timer ran
    for op in ("qkv", "gate_up", "head"):
        assert float(rows[op][2]) > 0 and float(rows[op][4]) > 0, (op, lines)  # bytes, op / memory time
    assert "limit" in lines[-1]
    assert step_profile.ENV not in __import__("os").environ  # restored
    with pytest.raises(SystemExit):
        step_profile.main([engine_dir("w8a8"), "--tokens", "1"])


def test_step_profile_two_threads_by_host_state(engine_dir, capsys, monkeypatch):
    """--state-gbs: rounds bracketed by a 2-thread read and split by it (a threshold every read
    passes: every round "fast", none "slow"); on two threads thread 1's time per op is printed."""
    from tritium.client.bench import step_profile
    monkeypatch.delenv(step_profile.ENV, raising=False)
    assert step_profile.main([engine_dir("w8a8"), "--tokens", "4", "--rounds", "2", "--threads", "2", "--wall",
                              "--bandwidth-gbs", "10", "--state-gbs", "0.001"]) == 0
    out = capsys.readouterr().out
    assert "no slow round" in out and "no contended round" in out and "fast state" in out, out
    assert "median of 2 of 2 rounds" in out, out
    rows = {ln[:22].strip(): ln[22:].split() for ln in out.splitlines() if ln[:22].strip() in ("qkv", "gate_up")}
    for op, cols in rows.items():
        assert len(cols) == 6 and float(cols[0]) > 0 and float(cols[5]) > 0, (op, out)  # both threads timed
    with pytest.raises(SystemExit):
        step_profile.main([engine_dir("w8a8"), "--state-gbs", "0"])
