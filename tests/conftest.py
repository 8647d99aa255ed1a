"""Shared fixtures: tiny checkpoints and engines (built once per session), SmolLM2."""
from __future__ import annotations

import contextlib
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from tiny_models import FAMILIES, make_checkpoint  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a real CUDA GPU (reported as skipped on CPU)")
    config.addinivalue_line("markers", "slow: takes more than a few seconds (SmolLM2, real server)")


@pytest.fixture(scope="module")
def one_thread():
    """Run a module's models on one intra-op thread: on a shared 2-core box, small ops otherwise
    wait on OpenMP barriers for longer than they compute."""
    import torch
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


CPU_PATHS = ("avx512", "avx2", "generic")  # kernels/cpu_isa.py, best first


def _force_cpu_path(mp, name: str) -> None:
    """Run the native CPU kernels of path `name` (TRITIUM_CPU_ISA) until mp is undone; a path
    this host cannot run is skipped with the reason (reported by `pytest -ra`), never silently."""
    from tritium.kernels import cpu_isa, cpu_native
    can = cpu_isa.runnable()
    if name not in can:
        pytest.skip(f"this CPU cannot run the {name} native path (it runs {', '.join(can)}; "
                    f"{name} needs {', '.join(sorted(cpu_isa.NEEDS[name]))})")
    mp.setenv("TRITIUM_CPU_ISA", name)
    mp.delenv("TRITIUM_NATIVE_CPU", raising=False)
    cpu_native.reset()
    assert cpu_native.available(), f"the {name} native kernels did not build (is a C compiler installed?)"
    assert cpu_native.isa() == name


@contextlib.contextmanager
def forced_cpu_path(name: str):
    from tritium.kernels import cpu_native
    with pytest.MonkeyPatch.context() as mp:
        _force_cpu_path(mp, name)
        try:
            yield name
        finally:
            cpu_native.reset()  # the next call selects again, under the restored environment


@pytest.fixture(params=CPU_PATHS)
def cpu_path(request):
    """Each test that takes it runs once per native CPU path (test ids name the path)."""
    with forced_cpu_path(request.param) as name:
        yield name


@pytest.fixture(scope="module", params=CPU_PATHS)
def native_bf16(request):
    """Batch-invariant bfloat16 numerics come from the native kernels (kernels/cpu_native.py),
    which exist on every path: the module's tests run once per path, forced with TRITIUM_CPU_ISA
    (ids name it). A path the host cannot run is skipped with the reason."""
    with forced_cpu_path(request.param) as name:
        yield name


@pytest.fixture(scope="module", params=CPU_PATHS[:2])
def native_bf16_x86(request):
    """native_bf16 for the SmolLM2 engine-level tests, which take minutes per path: the two x86
    SIMD paths (avx512, avx2). The portable path's batch invariance is covered by the kernel-level
    and tiny-model tests (test_determinism_kernels.py, test_determinism_models.py), which force
    every path."""
    with forced_cpu_path(request.param) as name:
        yield name


@pytest.fixture(scope="module")
def native_cpu():
    """The native kernels on the path this host picks by itself (what `tritium serve` runs)."""
    from tritium.kernels import cpu_native
    assert cpu_native.available(), "the native CPU kernels did not build (is a C compiler installed?)"
    return cpu_native.isa()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Factory: tiny_checkpoint(family, **overrides) -> checkpoint folder (cached per args)."""
    cache = {}

    def make(family: str = "llama", **overrides):
        key = (family, repr(sorted(overrides.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp(f"ckpt-{family}")
            cache[key] = make_checkpoint(family, str(path), **overrides)
        return cache[key]
    return make


@pytest.fixture(scope="session")
def tiny_engine(tiny_checkpoint, tmp_path_factory):
    """Factory: tiny_engine(family, dtype="float32", **build_kwargs) -> engine dir (cached)."""
    from tritium.builder.build import BuildOptions, build_engine
    cache = {}

    def make(family: str = "llama", dtype: str = "float32", **kw):
        key = (family, dtype, tuple(sorted(kw.items())))
        if key not in cache:
            out = str(tmp_path_factory.mktemp(f"engine-{family}-{dtype}") / "engine")
            build_engine(BuildOptions(source=tiny_checkpoint(family), output=out, dtype=dtype,
                                      progress=False, **kw))
            cache[key] = out
        return cache[key]
    return make


@pytest.fixture(scope="session")
def smollm2_gguf():
    from tritium.builder.default_model import smollm2_gguf_path
    return smollm2_gguf_path()


@pytest.fixture(scope="session")
def smollm2_layer0_qkv(smollm2_gguf):
    """SmolLM2 layer 0's fused qkv weight (N, K) with its real inputs, RMSNorm(embeddings):
    (w, hessian from 4096 calibration-text tokens, 2048 evaluation-text inputs to measure on)."""
    import torch

    from tritium.builder.calibration import default_calibration_text, default_eval_text
    from tritium.builder.gguf_loader import GGUFCheckpoint
    from tritium.builder.quant.gptq import HessianAccumulator
    from tritium.builder.quant.quant_pipeline import load_source_tokenizer
    from tritium.kernels.rms_norm_ref import rms_norm_ref
    ck = GGUFCheckpoint(smollm2_gguf)
    tok = load_source_tokenizer(smollm2_gguf)
    emb = ck.get("model.embed_tokens.weight").float()
    norm_w = ck.get("model.layers.0.input_layernorm.weight").float()
    w = torch.cat([ck.get(f"model.layers.0.self_attn.{p}_proj.weight").float() for p in "qkv"])
    eps = ck.model_config.rms_norm_eps

    def inputs(text, n):
        ids = torch.tensor(tok.encode(text, add_special_tokens=False).ids[:n])
        return rms_norm_ref(emb[ids], norm_w, eps)[0]
    acc = HessianAccumulator(w.shape[1])
    acc.add(inputs(default_calibration_text(), 4096))
    return w, acc.hessian(), inputs(default_eval_text(), 2048)


@pytest.fixture(scope="session")
def smollm2_engine(smollm2_gguf, tmp_path_factory):
    """Factory: smollm2_engine(dtype) -> engine dir built from SmolLM2's GGUF (cached)."""
    from tritium.builder.build import BuildOptions, build_engine
    cache = {}

    def make(dtype: str = "float32", **kw):
        key = (dtype, tuple(sorted(kw.items())))
        if key not in cache:
            out = str(tmp_path_factory.mktemp(f"smollm2-{dtype}") / "engine")
            build_engine(BuildOptions(source=smollm2_gguf, output=out, dtype=dtype, progress=False, **kw))
            cache[key] = out
        return cache[key]
    return make


@pytest.fixture(scope="session")
def smollm2_tokenizer_checkpoint(tiny_checkpoint, smollm2_gguf, tmp_path_factory):
    """Factory: a tiny random Llama (vocabulary 49,152) with SmolLM2's real tokenizer.json (and no
    tokenizer_config.json) -> checkpoint folder (cached). Random weights pick adversarial
    tokens: what structured-output tests want."""
    import shutil

    from tritium.builder.quant.quant_pipeline import load_source_tokenizer
    cache = {}

    def make(seed: int = 0):
        if seed not in cache:
            src = str(tmp_path_factory.mktemp("ckpt-smoltok"))
            shutil.copytree(tiny_checkpoint("llama", vocab_size=49152, seed=seed, max_position_embeddings=1024), src,
                            dirs_exist_ok=True)
            for f in os.listdir(src):
                if f.startswith(("tokenizer", "special_tokens")):
                    os.remove(os.path.join(src, f))
            if "tok" not in cache:
                cache["tok"] = load_source_tokenizer(smollm2_gguf)
            cache["tok"].save(os.path.join(src, "tokenizer.json"))
            cache[seed] = src
        return cache[seed]
    return make


@pytest.fixture(scope="session")
def smollm2_tokenizer_engine(smollm2_tokenizer_checkpoint, tmp_path_factory):
    """Factory: smollm2_tokenizer_checkpoint(seed) built into an engine dir (cached)."""
    from tritium.builder.build import BuildOptions, build_engine
    cache = {}

    def make(seed: int = 0, **kw):
        key = (seed, tuple(sorted(kw.items())))
        if key not in cache:
            out = str(tmp_path_factory.mktemp("engine-smoltok") / "engine")
            build_engine(BuildOptions(source=smollm2_tokenizer_checkpoint(seed), output=out, dtype="float32",
                                      progress=False, **kw))
            cache[key] = out
        return cache[key]
    return make


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf):
    """HF transformers' own load of the SmolLM2 GGUF (float32): the numerics oracle."""
    import warnings

    import torch
    from transformers import AutoModelForCausalLM
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(os.path.dirname(smollm2_gguf),
                                                    gguf_file=os.path.basename(smollm2_gguf),
                                                    dtype=torch.float32).eval()


__all__ = ["FAMILIES"]
