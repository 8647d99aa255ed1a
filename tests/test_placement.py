"""Placement on CPU with the CUDA calls stubbed at the edge (backend/placement.py `cuda`):
Triton instance kinds / device ids -> devices, set_device in every thread and worker that runs
kernels, the gpu_memory_utilization split among instances and the draft, and its load error.
The oracle for the numbers is arithmetic written out here (fractions of a made-up 80 GiB GPU)."""
import threading

import pytest
import torch

from tritium.backend import placement
from tritium.builder.repository import instance_group, llm_config, parse_gpus

GIB = 1 << 30


class FakeCuda(placement.CudaDevice):
    def __init__(self, total=80 * GIB, free=None):
        self.total, self.free = total, total if free is None else free
        self.calls = []  # (thread name, device index)

    def is_available(self):
        return True

    def device_count(self):
        return 2

    def set_device(self, index):
        self.calls.append((threading.current_thread().name, index))

    def mem_get_info(self, index):
        return self.free, self.total


@pytest.fixture
def fake_cuda(monkeypatch):
    fake = FakeCuda()
    monkeypatch.setattr(placement, "cuda", fake)
    return fake


@pytest.mark.parametrize("kind,dev_id,explicit,want", [
    ("GPU", "1", None, "cuda:1"), ("KIND_GPU", 0, None, "cuda:0"), ("GPU", "1", "cuda:1", "cuda:1"),
    ("CPU", "0", None, "cpu"), ("MODEL", "0", "cuda:3", "cuda:3"), ("MODEL", "0", None, None), ("", "0", None, None)])
def test_instance_device(kind, dev_id, explicit, want):
    assert placement.instance_device(kind, dev_id, explicit) == want


@pytest.mark.parametrize("kind,explicit", [("GPU", "cuda:0"), ("GPU", "cpu"), ("CPU", "cuda:0")])
def test_instance_device_contradiction_is_an_error(kind, explicit):
    with pytest.raises(ValueError, match="parameter device"):
        placement.instance_device(kind, "1", explicit)


def test_instances_on_device_counts_groups_per_gpu():
    cfg = {"instance_group": [{"kind": "KIND_GPU", "count": 2, "gpus": [0, 1]},
                              {"kind": "KIND_GPU", "count": 1, "gpus": [1]}, {"kind": "KIND_CPU", "count": 4}]}
    assert placement.instances_on_device(cfg, 0) == 2
    assert placement.instances_on_device(cfg, "1") == 3
    assert placement.instances_on_device({"instance_group": [{"kind": "KIND_GPU", "count": 3}]}, 5) == 3


def test_repository_writes_kind_gpu_with_gpus():
    text = llm_config("m", "e", 4, instances=2, device="cuda", gpus=parse_gpus("0,1"))
    assert "instance_group [ { kind: KIND_GPU count: 2 gpus: [ 0, 1 ] } ]" in text
    assert "kind: KIND_CPU count: 3" in llm_config("m", "e", 4, instances=3)
    assert "gpus: [ 0 ]" in instance_group("cuda")
    for bad in (dict(device="tpu"), dict(device="cpu", gpus=[0]), dict(device="cuda", gpus=[0, 0]),
                dict(device="cuda", gpus=[-1])):
        with pytest.raises(ValueError, match="--device|--gpus"):
            instance_group(**bad)
    with pytest.raises(ValueError, match="--gpus"):
        parse_gpus("0,x")


def test_build_cli_placement_args_checked_before_the_build(tmp_path):
    import argparse
    from tritium.client.cli.build_cli import placement_args
    ns = lambda **kw: argparse.Namespace(**dict(dict(repo=str(tmp_path), instances=2, device="cuda", gpus="0,1",
                                                     gpu_memory_utilization=0.5), **kw))
    assert placement_args(ns()) == {"device": "cuda", "gpus": [0, 1], "params": {"gpu_memory_utilization": "0.5"}}
    with pytest.raises(ValueError, match="need --repo"):
        placement_args(ns(repo=None))
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        placement_args(ns(gpu_memory_utilization=1.5))
    with pytest.raises(ValueError, match="needs --device cuda"):
        placement_args(ns(device="cpu", gpus=None))


def test_bind_thread_sets_the_device_and_skips_cpu(fake_cuda):
    placement.bind_thread("cpu")
    placement.bind_thread(torch.device("cuda", 1))
    placement.bind_thread("cuda")
    assert [i for _, i in fake_cuda.calls] == [1, 0]


def test_engine_loop_thread_sets_its_device(fake_cuda):
    from tritium.backend.async_engine import AsyncLLMEngine

    class FakeEngine:  # only what the loop touches before it waits for work
        device, tokenizer, config, requests, _aborted = torch.device("cuda", 1), None, None, {}, []

        def has_unfinished(self):
            return False

        def close(self):
            pass
    eng = AsyncLLMEngine(engine=FakeEngine())
    eng._thread.join(0.5)  # the loop is waiting now; binding happened first
    assert ("tritium-engine-loop", 1) in fake_cuda.calls
    with eng._cv:  # stop the loop without the engine's shutdown path (the fake has no requests)
        eng._stopped = True
        eng._cv.notify()
    eng._thread.join(5)
    assert not eng._thread.is_alive()


def test_tp_worker_sets_its_device_before_loading(fake_cuda, monkeypatch):
    import argparse
    from tritium.backend.parallel import worker

    def stop(*a, **k):
        raise RuntimeError("loaded")
    monkeypatch.setattr(worker, "load_engine", stop)
    with pytest.raises(RuntimeError, match="loaded"):
        worker.serve(argparse.Namespace(device="cuda:3", threads=None, engine_dir="x", rank=3))
    assert fake_cuda.calls == [(threading.current_thread().name, 3)]


def test_draft_engine_sets_its_device(fake_cuda, monkeypatch):
    from tritium.backend.speculative import draft
    monkeypatch.setattr(draft, "check_same_vocabulary", lambda *a: None)
    monkeypatch.setattr(draft, "ModelRunner", lambda *a: None)

    class Cfg:
        class limits:
            block_size, max_seq_len = 16, 64
    t = threading.Thread(target=draft.DraftProposer, args=(Cfg, None, None, None, None, "cuda:1", 4), name="loop")
    t.start(), t.join()
    assert fake_cuda.calls == [("loop", 1)]


def test_memory_split_among_instances_and_draft():
    total, token, dtoken = 80 * GIB, 1000, 250
    one = placement.plan_kv_memory(total, 0.5, 1, 4 * GIB, token)
    assert one.share_bytes == 40 * GIB and one.target_kv_bytes == 36 * GIB and one.draft_kv_bytes == 0
    two = placement.plan_kv_memory(total, 0.5, 2, 4 * GIB, token)
    assert two.share_bytes == 20 * GIB and two.target_kv_bytes == 16 * GIB
    # The draft is taken first, sized for as many tokens as the target: 16 GiB - 1 GiB split 1000:250.
    d = placement.plan_kv_memory(total, 0.5, 2, 4 * GIB, token, draft_weight_bytes=GIB, draft_token_bytes=dtoken)
    assert d.draft_kv_bytes == 15 * GIB // 5 and d.target_kv_bytes == 15 * GIB - 15 * GIB // 5
    assert d.target_kv_bytes // token == d.draft_kv_bytes // dtoken
    declared = placement.plan_kv_memory(total, 0.5, 2, 4 * GIB, token, GIB, dtoken, draft_kv_bytes=2 * GIB)
    assert declared.draft_kv_bytes == 2 * GIB and declared.target_kv_bytes == 13 * GIB


def test_memory_budget_too_small_names_the_parameter():
    with pytest.raises(ValueError, match="gpu_memory_utilization 0.1 .* 4 instance"):
        placement.plan_kv_memory(80 * GIB, 0.1, 4, 3 * GIB, 1000)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be a number in \(0, 1\]"):
        placement.plan_kv_memory(80 * GIB, 1.2, 1, GIB, 1000)


def test_engine_kv_blocks_from_the_budget(fake_cuda, tiny_engine):
    """kv_budget.cuda_kv_blocks on a real (tiny) engine model: blocks = share minus the weights
    and the draft's part, over bytes per block; the free-memory check at load names the parameter."""
    from tritium.backend.kv_budget import cuda_kv_blocks
    from tritium.backend.loader import load_engine
    from tritium.backend.model_runner import kv_bytes_per_block
    cfg, model, _ = load_engine(tiny_engine("llama"), "cpu")
    fake_cuda.total = fake_cuda.free = 64 << 20  # a 64 MiB "GPU"
    w, block = placement.module_bytes(model), kv_bytes_per_block(cfg)
    assert w == sum(p.numel() * p.element_size() for p in list(model.parameters()) + list(model.buffers()))
    n1, none = cuda_kv_blocks(cfg, model, "cuda:0", 0.5, 1)
    n2, _ = cuda_kv_blocks(cfg, model, "cuda:0", 0.5, 2)
    assert none is None and n1 == (int(fake_cuda.total * 0.5) - w) // block
    assert n2 == (int(fake_cuda.total * 0.5) // 2 - w) // block
    t, d = cuda_kv_blocks(cfg, model, "cuda:0", 0.5, 2, draft=(cfg, model))  # a draft as big as the target
    assert d == t and t == (int(fake_cuda.total * 0.5) // 2 - 2 * w) // 2 // block
    fake_cuda.free = block  # another process holds the rest
    with pytest.raises(ValueError, match="does not fit on cuda:0.*gpu_memory_utilization"):
        cuda_kv_blocks(cfg, model, "cuda:0", 0.5, 1)


def test_backend_instance_args_pick_the_device(fake_cuda):
    """What the Triton backend's initialize() does with Triton's args (backend/triton_backend/model.py)."""
    cfg = {"instance_group": [{"kind": "KIND_GPU", "count": 2, "gpus": [0, 1]}]}
    kw = {}
    placement.apply_instance_placement({"model_instance_kind": "GPU", "model_instance_device_id": "1"}, cfg, kw)
    assert kw == {"device": "cuda:1", "instances_on_device": 2} and fake_cuda.calls[-1][1] == 1
    kw = {}
    placement.apply_instance_placement({"model_instance_kind": "CPU", "model_instance_device_id": "0"}, {}, kw)
    assert kw == {"device": "cpu"} and len(fake_cuda.calls) == 1


def test_gpu_memory_utilization_parameter_is_checked():
    from tritium.backend.engine_options import engine_setup, options_from_params
    assert engine_setup(options_from_params({"gpu_memory_utilization": "0.5"})).engine_kwargs == {
        "gpu_memory_utilization": 0.5}
    for bad in ("0", "1.5", "half"):
        with pytest.raises(ValueError, match=r"parameter gpu_memory_utilization must be a number in \(0, 1\]"):
            options_from_params({"gpu_memory_utilization": bad})


def test_build_cli_writes_gpu_instance_groups(tiny_checkpoint, tmp_path):
    from tritium.client.cli.main import main
    repo = tmp_path / "repo"
    assert main(["build", tiny_checkpoint("llama"), "-o", str(tmp_path / "e"), "--repo", str(repo), "--name", "m",
                 "--device", "cuda", "--gpus", "0,1", "--instances", "2", "--gpu-memory-utilization", "0.4",
                 "--quiet"]) == 0
    text = (repo / "m" / "config.pbtxt").read_text()
    assert "instance_group [ { kind: KIND_GPU count: 2 gpus: [ 0, 1 ] } ]" in text
    assert 'key: "gpu_memory_utilization" value { string_value: "0.4" }' in text
    assert "KIND_CPU" in (repo / "m_preprocessing" / "config.pbtxt").read_text()  # tokenizers stay on the CPU
    assert main(["build", tiny_checkpoint("llama"), "-o", str(tmp_path / "e2"), "--gpus", "0"]) == 2


def test_tensor_parallel_ranks_size_their_cache_from_the_budget(fake_cuda, tiny_engine):
    """parallel/handshake.py: rank 0's gpu_memory_utilization and instance count reach every rank
    (one broadcast), each sizes its cache on its own GPU from them, and all take the minimum."""
    from tritium.backend.kv_budget import cuda_kv_blocks
    from tritium.backend.loader import load_engine
    from tritium.backend.parallel.handshake import agree_num_blocks

    class OneRankGroup:  # what rank 0 broadcasts is what this "worker" receives
        sent = None

        def broadcast(self, t):
            if self.sent is None:
                self.sent = t.clone()
            else:
                t.copy_(self.sent)

        def all_reduce_min(self, v):
            return v
    cfg, model, _ = load_engine(tiny_engine("llama"), "cpu")
    fake_cuda.total = fake_cuda.free = 64 << 20
    tp = OneRankGroup()
    want = cuda_kv_blocks(cfg, model, "cuda:0", 0.3, 2)[0]
    assert agree_num_blocks(tp, cfg, 0, "cuda:0", model=model, gpu_memory_utilization=0.3, instances_on_device=2) == want
    assert agree_num_blocks(tp, cfg, 0, "cuda:1", model=model) == want  # the worker side: values from the broadcast
    assert want != cuda_kv_blocks(cfg, model, "cuda:0", None, 1)[0]
