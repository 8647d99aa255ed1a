"""No host synchronisation inside the layer loop of a step on the GPU path.

The Triton side runs here under Triton's interpreter (CPU tensors), so a CUDA sync cannot be
observed directly; instead every call that would sync or copy a CUDA tensor to or from the host
is counted while a decoder layer runs, when made from Tritium's own code (backend/, kernels/):
Tensor.item / tolist / numpy / cpu / __bool__ / __int__ / __float__ and torch.tensor(...) from
Python values. (Triton's interpreter itself moves tensors to numpy: its frames are not counted.)
On a GPU the same check is torch.cuda.set_sync_debug_mode("error") around the layer loop (the
GPU proof command, `tritium gpu-check`, is where that runs). A control run, with the per-step
split left to the first layer, shows that the counter sees such calls.
"""
import kernel_env  # noqa: F401  (must precede the kernel imports: sets TRITON_INTERPRET=1)
import os

import numpy as np
import pytest
import torch

import tritium.backend as backend_pkg
import tritium.kernels as kernels_pkg
from tritium.backend.config import EngineConfig, Limits, ModelConfig
from tritium.backend.device_step import DeviceStepOptions
from tritium.backend.model_runner import ModelRunner
from tritium.backend.models.decoder import DecoderLM
from tritium.backend.step_arrays import StepArrays
from tritium.kernels import ops

BS = 4
ROOTS = (os.path.dirname(backend_pkg.__file__), os.path.dirname(kernels_pkg.__file__))
WATCHED = ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__")


def _model():
    m = ModelConfig(architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, max_position_embeddings=64)
    cfg = EngineConfig(model=m, dtype="float32", limits=Limits(max_batch_size=4, max_seq_len=32, block_size=BS))
    torch.manual_seed(0)
    model = DecoderLM(cfg)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name != "cos_sin_cache":
                buf.copy_(1 + 0.1 * torch.randn_like(buf) if "norm" in name else torch.randn_like(buf) * 0.2)
    return cfg, model.eval()


def _arrays(seqs):
    """seqs: (tokens, num_computed, num_new, block_table) -> StepArrays of one step."""
    ids, pos, slots, lens, rows, qsl = [], [], [], [], [], [0]
    for toks, done, n, table in seqs:
        for p in range(done, done + n):
            ids.append(toks[p])
            pos.append(p)
            slots.append(table[p // BS] * BS + p % BS)
        lens.append(done + n)
        qsl.append(qsl[-1] + n)
        if done + n == len(toks):
            rows.append(qsl[-1] - 1)
    width = max(len(t) for *_, t in seqs)
    tables = np.zeros((len(seqs), width), dtype=np.int32)
    for i, (*_, t) in enumerate(seqs):
        tables[i, :len(t)] = t
    i64 = lambda x: np.asarray(x, dtype=np.int64)  # noqa: E731
    return StepArrays(i64(ids), i64(pos), i64(slots), np.asarray(qsl, dtype=np.int32),
                      np.asarray(lens, dtype=np.int32), tables, i64(rows), np.zeros((0, 2), dtype=np.int64))


STEPS = [  # prefill + chunk, mixed prefill/decode, pure decode (twice)
    [([1, 2, 3, 4, 5], 0, 5, [3, 7]), ([9, 8, 7, 6], 0, 2, [1])],
    [([1, 2, 3, 4, 5, 6], 5, 1, [3, 7]), ([9, 8, 7, 6], 2, 2, [1])],
    [([1, 2, 3, 4, 5, 6, 7], 6, 1, [3, 7]), ([9, 8, 7, 6, 5], 4, 1, [1, 2])],
    [([1, 2, 3, 4, 5, 6, 7, 8], 7, 1, [3, 7]), ([9, 8, 7, 6, 5, 4], 5, 1, [1, 2])],
]


class SyncCounter:
    def __init__(self, monkeypatch, model):
        self.inside = False
        self.calls = []
        for name in WATCHED:
            self._wrap_method(monkeypatch, name)
        real_tensor = torch.tensor

        def tensor(*a, **k):
            self._note("torch.tensor")
            return real_tensor(*a, **k)
        monkeypatch.setattr(torch, "tensor", tensor)
        for layer in model.layers:
            layer.register_forward_pre_hook(lambda *a: setattr(self, "inside", True))
            layer.register_forward_hook(lambda *a: setattr(self, "inside", False))

    def _note(self, what):
        if not self.inside:
            return
        import sys
        caller = sys._getframe(2).f_code.co_filename
        if caller.startswith(ROOTS):
            self.calls.append(f"{what} from {os.path.basename(caller)}:{sys._getframe(2).f_lineno}")

    def _wrap_method(self, monkeypatch, name):
        real = getattr(torch.Tensor, name)

        def wrapped(t, *a, **k):
            self._note(f"Tensor.{name}")
            return real(t, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, wrapped)


@pytest.mark.parametrize("static", [False, True], ids=["staged", "static-buffers"])
def test_no_host_sync_in_the_layer_loop(monkeypatch, static):
    monkeypatch.setenv("TRITIUM_KERNELS", "triton")
    cfg, model = _model()
    opts = DeviceStepOptions(device_sampling=True, staged=True, cuda_graphs=static)
    runner = ModelRunner(cfg, model, 16, torch.device("cpu"), step_options=opts)
    counter = SyncCounter(monkeypatch, model)
    for step in STEPS:
        logits = runner.execute(_arrays(step))
        assert logits.shape[0] == sum(done + n == len(t) for t, done, n, _ in step)
        assert torch.isfinite(logits).all()
    assert counter.calls == []
    if static:
        assert runner.static_decode.num_steps == 2  # the two pure decode steps, on bucket 2


def test_the_counter_sees_a_split_built_inside_the_loop(monkeypatch):
    """Control: without the per-step split, the first layer builds it (host -> device copies)."""
    monkeypatch.setenv("TRITIUM_KERNELS", "triton")
    cfg, model = _model()
    runner = ModelRunner(cfg, model, 16, torch.device("cpu"),
                         step_options=DeviceStepOptions(device_sampling=True, staged=True, cuda_graphs=False))
    monkeypatch.setattr(ops, "attention_plan", lambda meta: None)
    counter = SyncCounter(monkeypatch, model)
    runner.execute(_arrays(STEPS[0]))
    runner.execute(_arrays(STEPS[1]))
    assert any("torch.tensor" in c for c in counter.calls), counter.calls
