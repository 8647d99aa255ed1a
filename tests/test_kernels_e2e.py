"""End to end: a tiny random decoder through the Triton kernels (interpreter, CPU) gives the
reference path's greedy tokens, over a paged cache with chunked prefill and mixed batches.
"""
from __future__ import annotations

import kernel_env  # noqa: F401  (must precede the kernel imports: sets TRITON_INTERPRET=1)
import pytest
import torch
from kernel_env import new_rng

from tritium.kernels.attention_metadata import AttentionMetadata
from tritium.backend.config import EngineConfig, KVCacheConfig, Limits, ModelConfig, RopeConfig
from tritium.backend.models.decoder import DecoderLM

BLOCK_SIZE = 8
NUM_NEW_TOKENS = 6
KV_DTYPES = {"auto": None, "int8": torch.int8, "fp8": torch.float8_e4m3fn}


def tiny_model(kv: str) -> DecoderLM:
    m = ModelConfig(architecture="mistral", vocab_size=96, hidden_size=64, intermediate_size=128,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6,
                    max_position_embeddings=128,
                    rope=RopeConfig(theta=10000.0, scaling_type="llama3", factor=8.0,
                                    original_max_position_embeddings=16),
                    tie_word_embeddings=True, sliding_windows=(None, 7))
    cfg = EngineConfig(model=m, dtype="float32", kv_cache=KVCacheConfig(dtype=kv),
                       limits=Limits(max_batch_size=4, max_seq_len=64, block_size=BLOCK_SIZE))
    model = DecoderLM(cfg)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name == "cos_sin_cache":
                continue
            if "norm" in name:
                buf.copy_(1 + 0.1 * torch.randn_like(buf))
            else:
                buf.copy_(torch.randn_like(buf) * (0.5 if "embed" in name else 0.15))
    if KV_DTYPES[kv] is not None:
        qmax = 127.0 if kv == "int8" else 448.0
        for layer in model.layers:
            layer.k_scale = torch.rand(m.num_kv_heads) * 4.0 / qmax + 1.0 / qmax
            layer.v_scale = torch.rand(m.num_kv_heads) * 4.0 / qmax + 1.0 / qmax
    return model.eval()


def greedy(model: DecoderLM, prompts, chunks, kv: str):
    """Manual engine loop: step 0 prefills chunks[i] tokens of each prompt, step 1 the rest
    (next to decodes of finished prompts), then decode. Returns (tokens, logits per step)."""
    m = model.cfg.model
    dtype = KV_DTYPES[kv] or torch.float32
    num_blocks = 40
    shape = (num_blocks, BLOCK_SIZE, m.num_kv_heads, m.head_dim)
    caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in model.layers]
    free = list(range(num_blocks))[::-1]
    seqs = [{"tokens": list(p), "done": 0, "table": [], "prompt": len(p)} for p in prompts]
    all_logits = []
    for step in range(NUM_NEW_TOKENS + 2):
        ids, pos, qlens, slens = [], [], [], []
        for i, s in enumerate(seqs):
            n = chunks[i] if step == 0 else len(s["tokens"]) - s["done"]
            ids += s["tokens"][s["done"]:s["done"] + n]
            pos += list(range(s["done"], s["done"] + n))
            qlens.append(n)
            slens.append(s["done"] + n)
            while len(s["table"]) * BLOCK_SIZE < slens[-1]:
                s["table"].append(free.pop())
        meta = AttentionMetadata.build(qlens, slens, [s["table"] for s in seqs], BLOCK_SIZE)
        with torch.no_grad():
            hidden = model(torch.tensor(ids), torch.tensor(pos), caches, meta)
            last = torch.tensor(meta.query_start_loc[1:].tolist()) - 1
            logits = model.compute_logits(hidden[last])
        all_logits.append(logits)
        for i, s in enumerate(seqs):
            s["done"] = slens[i]
            if s["done"] == len(s["tokens"]) and len(s["tokens"]) - s["prompt"] < NUM_NEW_TOKENS:
                s["tokens"].append(int(logits[i].argmax()))
    return [s["tokens"][s["prompt"]:] for s in seqs], all_logits


# Logit tolerance per KV storage. With a float cache both paths do the same fp32 maths. With a
# quantized cache, a K/V value that lands within ~1e-6 of a rounding boundary (round-half for
# INT8, the E4M3 grid for FP8) can round one step apart after the ~1e-7 upstream differences;
# one step is |scale| (<= 5/127) for INT8 and 1/16 of the value for FP8, which moves the logits
# by up to ~1e-2 (measured over seeds 0-149: INT8 max 1.8e-2, FP8 max 1.7e-3; CI once drew a
# seed with an INT8 flip, 1.3e-2). A wrong scale, layout or dequantisation moves them by O(1).
LOGIT_ATOL = {"auto": 1e-4, "int8": 5e-2, "fp8": 5e-2}


def compare_greedy(got, ref, kv: str, msg: str) -> None:
    """Logits agree within LOGIT_ATOL[kv] at every step; greedy tokens agree, except that a
    quantized cache may flip a token whose top-2 reference margin is inside the tolerance (after
    which the runs diverge and the comparison stops)."""
    (got_tokens, got_logits), (ref_tokens, ref_logits) = got, ref
    atol = LOGIT_ATOL[kv]
    assert all(len(t) == NUM_NEW_TOKENS for t in ref_tokens), msg
    for step, (g, r) in enumerate(zip(got_logits, ref_logits)):
        torch.testing.assert_close(g, r, rtol=0, atol=atol, msg=f"step {step} {msg}")
        flipped = g.argmax(-1) != r.argmax(-1)
        if flipped.any():
            assert kv != "auto", f"greedy token differs at step {step} with a float cache {msg}"
            top2 = r.topk(2, dim=-1).values
            margin = (top2[:, 0] - top2[:, 1])[flipped]
            assert (margin <= 2 * atol).all(), f"token flip at step {step} with margin {margin} {msg}"
            return
    assert got_tokens == ref_tokens, msg


@pytest.mark.parametrize("kv", ["auto", "int8", "fp8"])
def test_tiny_model_greedy_kernel_e2e(kv, monkeypatch):
    rng, seed = new_rng()
    model = tiny_model(kv)
    lens = [rng.randint(2, 13), rng.randint(9, 20), 1 + rng.randint(1, 6)]
    prompts = [[rng.randrange(96) for _ in range(n)] for n in lens]
    chunks = [lens[0], rng.randint(1, lens[1] - 1), lens[2]]  # the second prompt is chunked
    monkeypatch.setenv("TRITIUM_KERNELS", "reference")
    ref = greedy(model, prompts, chunks, kv)
    monkeypatch.setenv("TRITIUM_KERNELS", "triton")
    got = greedy(model, prompts, chunks, kv)
    compare_greedy(got, ref, kv, f"seed={seed} kv={kv} prompts={lens} chunks={chunks}")


def test_triton_mode_actually_runs_the_kernels(monkeypatch):
    """Guard against a silent fallback: in triton mode the ops call the Triton launchers."""
    from tritium.kernels import elementwise_triton, ops
    calls = []
    real = elementwise_triton.silu_mul
    monkeypatch.setattr(elementwise_triton, "silu_mul", lambda x: calls.append(1) or real(x))
    monkeypatch.setenv("TRITIUM_KERNELS", "triton")
    x = torch.randn(3, 8)
    torch.testing.assert_close(ops.silu_mul(x), torch.nn.functional.silu(x[:, :4]) * x[:, 4:])
    assert calls == [1]
    monkeypatch.setenv("TRITIUM_KERNELS", "bogus")
    with pytest.raises(ValueError, match="TRITIUM_KERNELS"):
        ops.silu_mul(x)


def _engine_greedy(engine_dir, prompts):
    from tritium.backend.engine import LLMEngine
    from tritium.backend.sampling_params import SamplingParams
    engine = LLMEngine(engine_dir, device="cpu", num_kv_blocks=24, max_num_batched_tokens=16)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), prompt_token_ids=p, params=SamplingParams(max_tokens=6, temperature=0.0))
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_engine_greedy_kernel_e2e(family, tiny_engine, monkeypatch):
    """The real engine (scheduler, chunked prefill, prefix cache) on a built tiny engine."""
    rng, seed = new_rng()
    engine_dir = tiny_engine(family)
    shared = [rng.randrange(1000) for _ in range(rng.randint(17, 24))]  # > one block: prefix reuse
    prompts = [shared + [rng.randrange(1000) for _ in range(rng.randint(1, 9))] for _ in range(2)]
    prompts.append([rng.randrange(1000) for _ in range(rng.randint(2, 30))])
    monkeypatch.setenv("TRITIUM_KERNELS", "reference")
    ref = _engine_greedy(engine_dir, prompts)
    monkeypatch.setenv("TRITIUM_KERNELS", "triton")
    got = _engine_greedy(engine_dir, prompts)
    assert got == ref, f"seed={seed} family={family} prompt lens={[len(p) for p in prompts]}"


def test_ops_registry_kernel_sides_agree(monkeypatch):
    """Every op of the registry gives the same answer on its triton and reference sides."""
    from tritium.builder.quant.quantize_fp8 import quantize_fp8, quantize_fp8_grouped
    from tritium.builder.quant.quantize_int4 import quantize_int4
    from tritium.builder.quant.quantize_int8 import quantize_int8, quantize_int8_source_grid
    from tritium.kernels import ops
    from tritium.kernels.rotary_ref import rope_cos_sin_cache, rope_inv_freq
    rng, seed = new_rng()
    x, w, b = torch.randn(5, 64), torch.randn(48, 64) * 0.1, torch.randn(48)
    q4 = quantize_int4(w, 32)
    q8, qf = quantize_int8(w), quantize_fp8(w)
    q8g, qfg = quantize_int8_source_grid(w, 32), quantize_fp8_grouped(w, 32, asymmetric=True)
    q, k = torch.randn(5, 4, 16), torch.randn(5, 2, 16)
    cs = rope_cos_sin_cache(rope_inv_freq(16, 10000.0), 32)
    pos = torch.randint(0, 32, (5,))
    calls = {
        "rms_norm": lambda: ops.rms_norm(x, torch.randn(64).abs(), 1e-6, x * 0.5),
        "rotary": lambda: ops.rotary(q, k, pos, cs),
        "silu_mul": lambda: ops.silu_mul(x),
        "linear_w4a16": lambda: ops.linear_w4a16(x, *q4, 32, None, b),
        "linear_w8a16": lambda: ops.linear_w8a16(x, *q8, b),
        "linear_w8a16 grouped": lambda: ops.linear_w8a16(x, *q8g[:2], b, zeros=q8g[2], group_size=32),
        "linear_w8a16 fp8 grouped": lambda: ops.linear_w8a16(x, *qfg[:2], b, zeros=qfg[2], group_size=32),
        "linear_fp8": lambda: ops.linear_fp8(x, *qf, b),
    }
    for name, call in calls.items():
        torch.manual_seed(seed)
        monkeypatch.setenv("TRITIUM_KERNELS", "reference")
        want = call()
        torch.manual_seed(seed)
        monkeypatch.setenv("TRITIUM_KERNELS", "triton")
        got = call()
        for g, r in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5, msg=f"{name} seed={seed}")
