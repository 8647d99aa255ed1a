"""The device step on CPU: staged inputs (one packed copy, persistent block tables updated by
changed entries) equal the plain host inputs; the static decode buffers (the CUDA-graph path,
run eagerly here) give the eager path's logits bit for bit and its tokens, with padding rows
that touch neither the KV cache nor the outputs; the device sampler inside the engine gives the
host sampler's tokens (greedy, seeded, n > 1, speculative). The host-sync count of the layer
loop is in test_device_step_sync.py (it needs Triton's interpreter)."""
import numpy as np
import pytest
import torch

from tritium.backend.decode_graphs import buckets
from tritium.backend.device_step import DeviceStepOptions, PersistentTable, StepBuffers
from tritium.backend.engine import LLMEngine
from tritium.backend.sampler_device import DeviceSampler
from tritium.backend.sampling_params import SamplingParams
from tritium.backend.speculative.config import SpeculativeConfig
from tritium.backend.step_arrays import StepArrays

EAGER = DeviceStepOptions(device_sampling=False, staged=False, cuda_graphs=False)
DEVICE = DeviceStepOptions(device_sampling=True, staged=True, cuda_graphs=False)
STATIC = DeviceStepOptions(device_sampling=True, staged=True, cuda_graphs=True)


def _arrays(tables, seq_lens):
    b = len(seq_lens)
    t = np.array(tables, dtype=np.int32)
    return StepArrays(np.arange(b, dtype=np.int64) + 5, np.array(seq_lens, dtype=np.int64) - 1,
                      np.arange(b, dtype=np.int64) * 3, np.arange(b + 1, dtype=np.int32),
                      np.array(seq_lens, dtype=np.int32), t, np.arange(b, dtype=np.int64),
                      np.zeros((0, 2), dtype=np.int64))


def test_buckets():
    assert buckets(1) == [1]
    assert buckets(16) == [1, 2, 4, 8, 16]
    assert buckets(20) == [1, 2, 4, 8, 16, 20]
    assert buckets(100) == [1, 2, 4, 8, 16, 32, 64, 96, 100]


def test_staged_upload_sends_only_changed_table_entries():
    buf = StepBuffers(torch.device("cpu"))
    steps = [([[1, 2], [3, 0]], [9, 5]),       # first step: every nonzero entry is new
             ([[1, 2], [3, 0]], [10, 6]),      # decode inside the same blocks: nothing to send
             ([[1, 2, 7], [3, 0, 0]], [17, 7]),  # sequence 0 got block 7: one entry
             ([[3, 4], [1, 2]], [3, 12])]      # the batch changed order: both rows differ
    sent = []
    for tables, lens in steps:
        a = _arrays(tables, lens)
        before = buf.tables.num_entries_copied
        ids, pos, slots, qsl, seq_lens, bt, rows = buf.upload(a)
        sent.append(buf.tables.num_entries_copied - before)
        assert torch.equal(bt, torch.from_numpy(a.block_tables))
        assert bt.dtype == torch.int32 and qsl.dtype == torch.int32 and seq_lens.dtype == torch.int32
        for got, want in ((ids, a.input_ids), (pos, a.positions), (slots, a.slot_mapping), (qsl, a.query_start_loc),
                          (seq_lens, a.seq_lens), (rows, a.logit_rows)):
            assert torch.equal(got.long(), torch.from_numpy(want).long())
    assert sent == [3, 0, 1, 4]


def test_fixed_table_refuses_to_grow():
    t = PersistentTable(torch.device("cpu"), 2, 3, fixed=True)
    with pytest.raises(ValueError, match="static buffer"):
        t.changes(np.zeros((3, 3), dtype=np.int32))


def test_options_resolve_per_device():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert DeviceStepOptions().resolve(cpu) == DeviceStepOptions(False, False, False, None)
    assert DeviceStepOptions().resolve(cuda) == DeviceStepOptions(True, True, True, None)
    assert DeviceStepOptions(cuda_graphs=False).resolve(cuda).cuda_graphs is False
    # static buffers imply staged inputs
    assert DeviceStepOptions(staged=False, cuda_graphs=True).resolve(cpu).staged is True


class Recorder:
    """Wraps runner.run to keep every step's logits (a host copy)."""

    def __init__(self, engine):
        self.logits = []
        run = engine.runner.run

        def wrapped(sched):
            out = run(sched)
            self.logits.append(out.detach().cpu().clone())
            return out
        engine.runner.run = wrapped


def _run(engine_dir, opts, prompts, params, deterministic=None, before=None, **kw):
    eng = LLMEngine(engine_dir, device="cpu", num_kv_blocks=64, max_num_seqs=8, device_step=opts,
                    deterministic=deterministic, **kw)
    if before is not None:
        before(eng)
    rec = Recorder(eng)
    outs = eng.generate(prompt_token_ids=prompts, params=params)
    return eng, rec.logits, [[o.token_ids for o in out.outputs] for out in outs]


PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30], [40, 41]]


def test_static_decode_path_equals_eager_bit_for_bit(tiny_engine, native_bf16):
    """A bf16 engine on the batch-invariant kernels (docs/determinism.md): the padded static batch
    gives the eager path's logits bits; the real blocks of the KV cache end up identical (padding
    wrote only to the scratch block)."""
    engine = tiny_engine("llama", dtype="bfloat16")
    params = [SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.8, top_k=20, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=4, ignore_eos=True),
              SamplingParams(max_tokens=4, temperature=0.7, min_p=0.1, seed=5, ignore_eos=True)]
    ea, la, ta = _run(engine, EAGER, PROMPTS, params, deterministic=True)
    sentinel = 7.0

    def fill_scratch(eng):
        for k, v in eng.runner.kv_caches:
            k[eng.runner.scratch_block] = sentinel
            v[eng.runner.scratch_block] = sentinel
    es, ls, ts = _run(engine, STATIC, PROMPTS, params, deterministic=True, before=fill_scratch)
    assert ta == ts
    assert len(la) == len(ls) and all(torch.equal(x, y) for x, y in zip(la, ls))
    sd = es.runner.static_decode
    assert sd is not None and sd.num_padded_rows > 0  # 3 live sequences ran on bucket 4
    nb = ea.runner.num_blocks
    assert es.runner.kv_caches[0][0].shape[0] == nb + 1  # the scratch block
    for (ka, va), (ks, vs) in zip(ea.runner.kv_caches, es.runner.kv_caches):
        assert torch.equal(ka[:nb], ks[:nb]) and torch.equal(va[:nb], vs[:nb])
    assert (es.runner.kv_caches[0][0][nb] != sentinel).any()  # padding rows did write: to scratch only


@pytest.mark.parametrize("opts", [DEVICE, STATIC], ids=["device-sampler", "static-buffers"])
def test_device_step_gives_the_host_tokens(tiny_engine, opts):
    """Default numerics: greedy, seeded sampling with penalties and logprobs, and n > 1."""
    engine = tiny_engine("llama")
    params = [SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0.9, seed=11, repetition_penalty=1.2, n=2, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=1.2, top_p=0.8, seed=12, frequency_penalty=0.3,
                             logprobs=1, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0.6, top_k=7, seed=13, logit_bias={3: 2.0}, ignore_eos=True)]
    _, la, ta = _run(engine, EAGER, PROMPTS, params)
    eng, lb, tb = _run(engine, opts, PROMPTS, params)
    assert ta == tb
    assert (eng.runner.static_decode is not None) == opts.cuda_graphs
    if opts.cuda_graphs:
        assert eng.runner.static_decode.num_steps >= 5
    for x, y in zip(la, lb):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)


def test_device_sampler_with_speculative_verification(tiny_engine):
    engine = tiny_engine("llama")
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6], [9, 8, 9, 8, 9, 8, 9]]
    params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=1.0, seed=21, ignore_eos=True)]
    spec = SpeculativeConfig("ngram", num_speculative_tokens=3)
    _, _, ta = _run(engine, EAGER, prompts, params, speculative=spec)
    eng, _, tb = _run(engine, STATIC, prompts, params, speculative=spec)
    assert ta == tb
    assert isinstance(eng.runner.sampler, DeviceSampler)
    assert eng.speculator.num_verify_rows > 0
