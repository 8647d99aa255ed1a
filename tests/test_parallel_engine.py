"""Tensor parallelism in-process: LLMEngine on a TP = 2 engine (rank 0 here, one spawned worker)
against the same model at TP = 1 and Hugging Face transformers (the numerics oracle).

Every engine here is closed by its test or fixture (workers killed in finalizers), and each test
that starts workers checks that none is left; collectives time out after TRITIUM_TP_TIMEOUT_S.
"""
from __future__ import annotations

import os
import random
import signal
import time

import pytest
import torch

from tritium.backend.async_engine import AsyncLLMEngine
from tritium.backend.engine import LLMEngine
from tritium.backend.parallel import runner as tp_runner
from tritium.backend.parallel.runner import TensorParallelWorkerError
from tritium.backend.sampling_params import SamplingParams

from test_runtime_engine import run_staggered, workload
from tp_utils import processes_with, record_logits, tp_timeout, wait_no_workers  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread", "tp_timeout")

PROMPTS = [[5, 17, 923, 44, 300, 2, 81, 999, 13, 640, 7, 7, 7, 250, 18, 402, 77, 31, 500, 61, 3],
           [1, 600, 601, 602], [999]]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def open_tp(engine_dir, **kw):
    return LLMEngine(engine_dir, device="cpu", threads_per_rank=1, **kw)


def greedy_with_logits(engine):
    logs = record_logits(engine)
    outs = engine.generate(prompt_token_ids=PROMPTS, params=GREEDY)
    return [o.outputs[0].token_ids for o in outs], logs


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_tp2_equals_tp1_and_hf_fp32(family, tiny_checkpoint, tiny_engine):
    """Same greedy tokens; every step's logits within 1e-4 (relative L2) of TP = 1 and of HF."""
    from transformers import AutoModelForCausalLM
    with LLMEngine(tiny_engine(family, "float32"), device="cpu", num_kv_blocks=64) as e1:
        tok1, log1 = greedy_with_logits(e1)
    path = tiny_engine(family, "float32", tensor_parallel_size=2)
    with open_tp(path, num_kv_blocks=64) as e2:
        tok2, log2 = greedy_with_logits(e2)
        workers = [p.pid for p in e2.runner.workers]
        assert len(workers) == 1
    assert tok2 == tok1
    assert len(log1) == len(log2)
    for a, b in zip(log2, log1):
        assert a.shape == b.shape and rel_err(a, b) < 1e-4
    # HF on prompt + generated tokens: row p predicts token p + 1. Step 0 holds the three prompts'
    # last rows; each later step one row per sequence.
    hf = AutoModelForCausalLM.from_pretrained(tiny_checkpoint(family), dtype=torch.float32).eval()
    for s, (prompt, gen) in enumerate(zip(PROMPTS, tok2)):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt + gen])).logits[0]
        ours = torch.stack([log2[step][s] for step in range(len(gen))])
        want = ref[len(prompt) - 1:len(prompt) - 1 + len(gen)]
        assert rel_err(ours, want) < 1e-4, (family, s, rel_err(ours, want))
    assert not wait_no_workers(path), "a worker outlived close()"
    for pid in workers:
        assert not os.path.exists(f"/proc/{pid}")  # reaped too, not a zombie


def test_build_records_the_layout_and_one_file_per_rank(tiny_engine):
    from tritium.backend.config import EngineConfig
    path = tiny_engine("llama", "float32", tensor_parallel_size=2)
    cfg = EngineConfig.load(path)
    assert cfg.tensor_parallel_size == 2
    assert [r["q_heads"] for r in cfg.tensor_parallel["ranks"]] == [[0, 4], [4, 6]]
    assert [r["kv_heads"] for r in cfg.tensor_parallel["ranks"]] == [[0, 2], [2, 3]]
    assert sorted(f for f in os.listdir(path) if f.endswith(".safetensors")) == \
        ["rank0.safetensors", "rank1.safetensors"]


def test_build_refuses_a_split_the_heads_cannot_take(tiny_checkpoint, tmp_path):
    from tritium.backend.parallel_layout import TensorParallelError
    from tritium.builder.build import BuildOptions, build_engine
    with pytest.raises(TensorParallelError, match="tensor_parallel_size 4 > num_kv_heads 3"):
        build_engine(BuildOptions(source=tiny_checkpoint("llama"), output=str(tmp_path / "e"), progress=False,
                                  tensor_parallel_size=4))
    assert not (tmp_path / "e").exists()


@pytest.fixture(scope="module")
def llama_tp2(tiny_engine):
    """(TP = 1 engine, TP = 2 engine dir) for the scheduling tests; block size 4 for preemption."""
    one = LLMEngine(tiny_engine("llama", "float32", block_size=4), device="cpu", num_kv_blocks=128)
    yield one, tiny_engine("llama", "float32", block_size=4, tensor_parallel_size=2)


@pytest.mark.parametrize("mode", ["roomy", "preempt", "chunks"])
def test_batched_equals_solo_at_tp2(llama_tp2, mode):
    """Staggered batches at TP = 2 give each request the tokens it gets alone at TP = 1, also
    when the KV pool is too small (preemption) and with prefill in small chunks."""
    one, path = llama_tp2
    kw = {"roomy": dict(num_kv_blocks=128), "preempt": dict(num_kv_blocks=16),
          "chunks": dict(num_kv_blocks=128, max_num_batched_tokens=5)}[mode]
    reqs, arrivals = workload(seed=7 + len(mode))
    solo = [one.generate(prompt_token_ids=[p], params=SamplingParams(max_tokens=m, temperature=0.0,
                                                                       ignore_eos=True))[0].outputs[0].token_ids
            for p, m in reqs]
    with open_tp(path, **kw) as eng:
        outs = run_staggered(eng, reqs, arrivals)
        st = eng.stats()
    assert [o.outputs[0].token_ids for o in outs] == solo
    if mode == "preempt":
        assert st["preemptions"] > 0
    assert st["kv_blocks_used"] == 0
    assert not wait_no_workers(path)


def test_prefix_caching_at_tp2(llama_tp2):
    """The second request reuses the first one's cached prefix blocks on every rank: it computes
    only its own tokens and still gets the TP = 1 answer."""
    one, path = llama_tp2
    rng = random.Random(3)
    shared = [rng.randrange(3, 1000) for _ in range(12)]
    a, b = shared + [5, 6, 7], shared + [11, 12, 13, 14]
    p = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with open_tp(path, num_kv_blocks=64) as eng:
        (out_a,) = eng.generate(prompt_token_ids=[a], params=p)
        (out_b,) = eng.generate(prompt_token_ids=[b], params=p)
    assert out_b.metrics["num_cached_tokens"] == 12
    assert out_b.metrics["num_scheduled_tokens"] == 4 + 5
    for prompt, out in ((a, out_a), (b, out_b)):
        ref = one.generate(prompt_token_ids=[prompt], params=p)[0].outputs[0].token_ids
        assert out.outputs[0].token_ids == ref


def test_int4_gptq_act_order_at_tp2_equals_tp1(tiny_checkpoint, tmp_path):
    """GPTQ act-order (g_idx on qkv, gate_up and down; o_proj kept float so that both builds hold
    the same weights): TP = 2 gives the TP = 1 tokens. Hidden 96 / intermediate 128 so that
    group size 32 fits every layer. The int4 GEMMs take bfloat16 activations, so the row-parallel
    partial sums round differently from the whole sum: a tiny random model's near-ties may then
    flip. Tokens must agree up to a step where TP = 1's top two logits are within 0.02 (a tie
    at bfloat16's resolution), and the logits up to there within 2e-2 relative."""
    from tritium.backend.config import EngineConfig
    from tritium.builder.build import BuildOptions, build_engine
    ckpt = tiny_checkpoint("llama", hidden_size=96, intermediate_size=128)
    dirs = {}
    for n in (1, 2):
        dirs[n] = str(tmp_path / f"tp{n}")
        build_engine(BuildOptions(source=ckpt, output=dirs[n], dtype="float32", progress=False,
                                  quantization="int4-gptq", group_size=32, exclude_modules="*.o_proj",
                                  calibration_samples=4, tensor_parallel_size=n))
    layers = EngineConfig.load(dirs[2]).quantization.layers
    assert layers["layers.0.down_proj"].act_order  # the row-parallel down_proj is sharded by g_idx
    with LLMEngine(dirs[1], device="cpu", num_kv_blocks=64) as e1:
        tok1, log1 = greedy_with_logits(e1)
    with open_tp(dirs[2], num_kv_blocks=64) as e2:
        tok2, log2 = greedy_with_logits(e2)
    for s, (a, b) in enumerate(zip(tok1, tok2)):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        for step in range(same):
            assert rel_err(log2[step][s], log1[step][s]) < 2e-2
        if same < len(a):  # a flip: only at a near-tie of TP = 1's own logits
            row = log1[same][s]
            assert abs(row[a[same]] - row[b[same]]).item() < 0.02, (s, same)
    assert sum(a == b for a, b in zip(tok1, tok2)) >= 2


@pytest.mark.parametrize("method", ["int8", "int4-rtn"])
def test_default_integer_dot_build_at_tp2_equals_tp1(tiny_checkpoint, tmp_path, method):
    """The default int8 / int4 build (--activation-quant auto: W8A8 after SmoothQuant, head centred / W4A8) at
    TP = 2: SmoothQuant runs on the whole model before the split, both builds record the same
    activations and factors, and the TP = 2 engine gives TP = 1's tokens up to near-ties (the
    criterion of the act-order test above: row-parallel partial sums round differently, which may
    move an activation code; logits within 2e-2 relative until a flip, a flip only where TP = 1's
    top two logits are within 0.02)."""
    from tritium.backend.config import EngineConfig
    from tritium.builder.build import BuildOptions, build_engine
    ckpt = tiny_checkpoint("llama", hidden_size=96, intermediate_size=128)
    dirs = {}
    for n in (1, 2):
        dirs[n] = str(tmp_path / f"tp{n}")
        build_engine(BuildOptions(source=ckpt, output=dirs[n], dtype="float32", progress=False, quantization=method,
                                  group_size=32, calibration_samples=4, eval_tokens=0, tensor_parallel_size=n))
    cfgs = {n: EngineConfig.load(d) for n, d in dirs.items()}
    assert cfgs[1].activation_quant == cfgs[2].activation_quant == "int8"
    assert cfgs[1].quantization.smoothquant == cfgs[2].quantization.smoothquant
    sq = cfgs[1].quantization.smoothquant
    if method == "int8":  # alpha 0.5 on every linear; the head centred (its mean logits split by vocabulary)
        assert sq == {"alpha": 0.5, "linears": 4 * cfgs[1].model.num_layers}
        head = "embed_tokens" if cfgs[1].model.tie_word_embeddings else "lm_head"
        assert cfgs[1].quantization.layers[head].centred and cfgs[2].quantization.layers[head].centred
    else:
        assert sq == {}
    with LLMEngine(dirs[1], device="cpu", num_kv_blocks=64) as e1:
        tok1, log1 = greedy_with_logits(e1)
    with open_tp(dirs[2], num_kv_blocks=64) as e2:
        assert e2.config.activation_quant == "int8"
        tok2, log2 = greedy_with_logits(e2)
    for s, (a, b) in enumerate(zip(tok1, tok2)):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        for step in range(same):
            assert rel_err(log2[step][s], log1[step][s]) < 2e-2
        if same < len(a):
            row = log1[same][s]
            assert abs(row[a[same]] - row[b[same]]).item() < 0.02, (s, same)
    assert sum(a == b for a, b in zip(tok1, tok2)) >= 2


def test_dead_worker_fails_requests_and_marks_the_engine_unhealthy(tiny_engine, monkeypatch):
    """SIGKILL the worker mid-service: the running request fails with an error naming the rank,
    the engine reports unhealthy, later requests are refused, and nothing is left running."""
    monkeypatch.setattr(tp_runner, "HEARTBEAT_S", 0.5)
    path = tiny_engine("llama", "float32", tensor_parallel_size=2)
    aeng = AsyncLLMEngine(path, device="cpu", num_kv_blocks=64, threads_per_rank=1)
    try:
        assert aeng.is_healthy
        (worker,) = aeng.engine.runner.workers
        stream = aeng.generate("a", prompt_token_ids=[1, 2, 3],
                               params=SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
        next(stream)  # the first token arrived: the request is running
        os.kill(worker.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(Exception) as err:
            for _ in stream:
                pass
        assert time.monotonic() - t0 < 30
        assert "worker rank 1 exited with code -9" in str(err.value)
        assert not aeng.is_healthy
        with pytest.raises(Exception, match="worker rank 1 exited"):
            aeng.generate("b", prompt_token_ids=[1, 2], params=SamplingParams(max_tokens=2))
    finally:
        aeng.shutdown()
    assert not wait_no_workers(path)


def test_idle_worker_death_is_noticed_without_a_request(tiny_engine, monkeypatch):
    monkeypatch.setattr(tp_runner, "HEARTBEAT_S", 0.3)
    path = tiny_engine("llama", "float32", tensor_parallel_size=2)
    aeng = AsyncLLMEngine(path, device="cpu", num_kv_blocks=64, threads_per_rank=1)
    try:
        aeng.engine.runner.workers[0].kill()
        deadline = time.monotonic() + 20
        while aeng.is_healthy and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not aeng.is_healthy
        assert "worker rank 1 exited" in aeng.failure
    finally:
        aeng.shutdown()
    assert not wait_no_workers(path)


def test_a_worker_that_cannot_start_fails_the_load_fast(tiny_engine, tmp_path):
    import shutil
    src = tiny_engine("llama", "float32", tensor_parallel_size=2)
    bad = str(tmp_path / "bad-engine")
    shutil.copytree(src, bad)
    with open(os.path.join(bad, "rank1.safetensors"), "wb") as f:
        f.write(b"not a safetensors file")
    t0 = time.monotonic()
    with pytest.raises(TensorParallelWorkerError, match="worker rank 1 exited with code 1"):
        open_tp(bad, num_kv_blocks=64)
    assert time.monotonic() - t0 < 60
    assert not processes_with(bad)


def test_a_rank_started_elsewhere_joins(tiny_engine, monkeypatch):
    """The multi-node set-up, with both 'nodes' on loopback: rank 0 starts no worker
    (TRITIUM_TP_LOCAL_RANKS=1) and waits at TRITIUM_TP_MASTER_ADDR:PORT; rank 1 is started by
    hand, as an operator would on the other machine. Same tokens as TP = 1; close() stops it."""
    import subprocess
    import sys

    from tritium.backend.parallel.comm import free_port
    path = tiny_engine("llama", "float32", tensor_parallel_size=2)
    port = free_port()
    monkeypatch.setenv("TRITIUM_TP_LOCAL_RANKS", "1")
    monkeypatch.setenv("TRITIUM_TP_MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("TRITIUM_TP_MASTER_PORT", str(port))
    proc = subprocess.Popen([sys.executable, "-m", "tritium.backend.parallel.worker", "--engine-dir", path,
                             "--rank", "1", "--world-size", "2", "--master-addr", "127.0.0.1",
                             "--master-port", str(port), "--device", "cpu", "--threads", "1"],
                            start_new_session=True)
    try:
        with open_tp(path, num_kv_blocks=64) as eng:
            assert eng.runner.workers == []  # nothing spawned locally
            tok2, _ = greedy_with_logits(eng)
        assert proc.wait(30) == 0  # told to stop by the engine's close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    with LLMEngine(tiny_engine("llama", "float32"), device="cpu", num_kv_blocks=64) as e1:
        tok1, _ = greedy_with_logits(e1)
    assert tok2 == tok1
