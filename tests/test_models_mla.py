"""DeepSeek-V3 and DeepSeek-V2 (V2-Lite's layout): multi-head latent attention (backend/models/mla.py)
and DeepSeek's routing (backend/models/moe_routing.py) against Hugging Face transformers on tiny
random checkpoints: fp32 logits within 1e-4 relative (L2) error and greedy tokens equal to
`generate`; the routers against transformers' own router modules; the latent cache's size per
token (the build report and the runner's pool) equal to (kv_lora_rank + qk_rope_head_dim) x dtype
bytes per layer; a decode step that never forms per-head K or V (every intermediate tensor
watched); batched == alone with chunked prefill, preemption and prefix reuse. TP, quantized
experts, refusals and serving: tests/test_models_mla_serving.py; the checkpoints:
tests/deepseek_models.py."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from deepseek_models import FAMILIES, V2, V3, ds_checkpoint, ds_engine  # noqa: F401 (fixtures)
from hf_oracle import PROMPTS, hf_model, rel_err
from simple_generate import generate_simple, prompt_logits
from test_models_engine import MODES, alone, run_staggered, workload
from tritium.backend.engine import LLMEngine
from tritium.backend.loader import load_engine
from tritium.backend.sampling_params import SamplingParams
from tritium.builder.hf_loader import model_config_from_hf

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_logits_and_greedy_match_hf(family, ds_checkpoint, ds_engine):
    path = ds_checkpoint(family)
    ref_model = hf_model(path)
    cfg, model, _ = load_engine(ds_engine(family), "cpu")
    m = cfg.model
    assert m.kv_lora_rank == 40 and m.num_experts == 8 and not m.sparse(0) and m.sparse(1)
    if family.startswith("deepseek_v3"):
        assert m.router_correction_bias and ref_model.model.layers[1].mlp.gate.e_score_correction_bias.abs().sum() > 0
    for ids in PROMPTS:
        with torch.no_grad():
            ref = ref_model(torch.tensor([ids])).logits[0]
        ours = prompt_logits(model, ids)
        assert rel_err(ours, ref) < 1e-4, (family, ids, rel_err(ours, ref))
        want = ref_model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                                  attention_mask=torch.ones(1, len(ids), dtype=torch.long))[0, len(ids):].tolist()
        got, _ = generate_simple(model, ids, 12, eos_token_ids=cfg.model.eos_token_ids)
        assert got == want, (family, ids)


def test_prompt_rows_expand_and_match_hf_and_the_absorbed_form(ds_checkpoint, ds_engine, monkeypatch):
    """A 90-token prompt (at least expand_min_rows = 60 new rows for these dims) expands its
    latents (backend/models/mla_prefill.py): logits within 1e-4 of transformers and within 1e-5 of
    the same model with every row absorbed; then a batch that mixes that prompt with decoding
    rows splits them (absorbed / expanded) and gives each sequence its tokens alone."""
    from tritium.backend.models import mla as mla_mod
    from tritium.backend.models.mla_prefill import expanded_attention
    _, model, _ = load_engine(ds_engine("deepseek_v3"), "cpu")
    assert model.layers[0].expand_min_rows == 60  # ceil(40 * (16 + 32) / (2 * 40 - 16 - 32))
    ids = [(7 * i + 3) % 997 + 2 for i in range(90)]
    calls = []
    monkeypatch.setattr(mla_mod, "expanded_attention", lambda *a: calls.append(a[0].shape) or expanded_attention(*a))
    ours = prompt_logits(model, ids)
    assert len(calls) == 3 and calls[0][0] == 90
    with torch.no_grad():
        ref = hf_model(ds_checkpoint("deepseek_v3"))(torch.tensor([ids])).logits[0]
    assert rel_err(ours, ref) < 1e-4, rel_err(ours, ref)
    for layer in model.layers:
        layer.expand_min_rows = float("inf")
    assert rel_err(prompt_logits(model, ids), ours) < 1e-5
    from tritium.backend.models.mla_prefill import row_split
    mixed = []
    monkeypatch.setattr(mla_mod, "row_split", lambda *a: (lambda sp: mixed.append(
        bool(sp.expanded) and sp.absorbed_meta is not None) or sp)(row_split(*a)))
    engine = LLMEngine(ds_engine("deepseek_v3", block_size=4), device="cpu", num_kv_blocks=96)
    reqs = [(ids[:12], 10), (ids[20:95], 6), (ids[5:9], 8)]  # the 75-token prompt arrives while the others decode
    outs = run_staggered(engine, reqs, [0, 2, 0])
    assert any(mixed)  # one step held both kinds of rows
    for (prompt, max_tokens), out in zip(reqs, outs):
        assert out.outputs[0].token_ids == alone(engine, prompt, max_tokens), len(prompt)
    assert engine.stats()["kv_blocks_used"] == 0


def test_bf16_engine_within_stated_tolerance(ds_checkpoint, ds_engine):
    """A bf16 V3 engine (packed bf16 linears on CPU, bf16 latent cache, float32 router) against
    float32 transformers: 3e-2 per position at 90% of the positions (routing is discontinuous, see
    test_models_moe.py)."""
    ref_model = hf_model(ds_checkpoint("deepseek_v3"))
    path = ds_engine("deepseek_v3", "bfloat16")
    _, model, _ = load_engine(path, "cpu")
    model.pack_for_cpu()
    # the router runs in float32 as transformers' does, from a float32 weight in the engine file
    assert model.layers[1].router.weight.dtype == torch.float32
    assert load_file(f"{path}/rank0.safetensors")["layers.1.router.weight"].dtype == torch.float32
    ids = PROMPTS[0]
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0]
    per = (prompt_logits(model, ids).float() - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert (per < 3e-2).float().mean().item() >= 0.9, per.tolist()


@pytest.mark.parametrize("method", ["noaux_tc", "group_limited_greedy", "greedy"])
def test_routers_match_transformers_router_modules(method):
    """moe_routing.route_grouped against transformers' DeepseekV3TopkRouter / DeepseekV2TopkRouter
    on 256 random tokens with 16 experts in 4 groups: the same experts and weights."""
    from transformers import AutoConfig
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from tritium.backend.models.moe_routing import route_grouped
    torch.manual_seed(0)
    v3 = method == "noaux_tc"
    cfg = AutoConfig.for_model("deepseek_v3" if v3 else "deepseek_v2", hidden_size=32, n_routed_experts=16,
                               num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                               norm_topk_prob=v3, topk_method=method)
    router = (DeepseekV3TopkRouter if v3 else DeepseekV2TopkRouter)(cfg)
    with torch.no_grad():
        router.weight.normal_(0, 1.0)
        if v3:
            router.e_score_correction_bias.normal_(0, 0.5)
    x = torch.randn(256, 32)
    with torch.no_grad():
        logits, ref_w, ref_ids = router(x)
    w, ids = route_grouped(logits, 4, "sigmoid" if v3 else "softmax", method, 4, 2, v3, 2.5,
                           router.e_score_correction_bias if v3 else None)
    order, ref_order = ids.argsort(-1), ref_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), ref_ids.gather(1, ref_order))
    torch.testing.assert_close(w.gather(1, order), ref_w.gather(1, ref_order), rtol=1e-6, atol=1e-7)
    if v3:  # the bias chose different experts than the uncorrected scores would have
        plain = route_grouped(logits, 4, "sigmoid", method, 4, 2, True, 2.5, None)[1]
        assert not torch.equal(plain.sort(-1).values, ids.sort(-1).values)


@pytest.mark.parametrize("over,dense", [(dict(), (0,)), (dict(first_k_dense_replace=2, num_hidden_layers=5), (0, 1)),
                                        (dict(first_k_dense_replace=1, moe_layer_freq=2, num_hidden_layers=5),
                                         (0, 1, 3))])
def test_dense_layers_follow_first_k_dense_replace_and_moe_layer_freq(over, dense):
    """Dense where i < first_k_dense_replace or i % moe_layer_freq != 0 (DeepSeek's rule; with
    moe_layer_freq 1 also transformers' layer types)."""
    m = model_config_from_hf(dict(V3, **over))
    assert m.dense_layers == dense
    assert m.shared_expert_intermediate_size == 32 and m.router_topk == "noaux_tc" and m.router_scoring == "sigmoid"


def test_kv_cache_bytes_per_token_are_the_latent(ds_engine, tiny_engine):
    """(kv_lora_rank + qk_rope_head_dim) x dtype bytes per layer: in the build report, in the
    runner's pool (one latent tensor per layer, no per-head K/V) and in the block budget."""
    from tritium.backend.model_runner import kv_bytes_per_block
    for dtype, elem in (("float32", 4), ("bfloat16", 2)):
        path = ds_engine("deepseek_v3", dtype)
        report = json.load(open(f"{path}/build_report.json"))["kv_cache"]
        assert report["bytes_per_token_per_layer"] == (40 + 8) * elem
        assert report["bytes_per_token"] == (40 + 8) * elem * 3
        engine = LLMEngine(path, device="cpu", num_kv_blocks=8)
        k, v = engine.runner.kv_caches[0]
        assert tuple(k.shape) == (8, 16, 1, 48) and v.numel() == 0
        pool = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in engine.runner.kv_caches)
        assert pool == 8 * 16 * report["bytes_per_token"] == 8 * kv_bytes_per_block(engine.runner.cfg)
    llama = load_engine(tiny_engine("llama"), "cpu")[0].model  # an ordinary cache: K and V per KV head
    per_layer = json.load(open(f"{tiny_engine('llama')}/build_report.json"))["kv_cache"]["bytes_per_token_per_layer"]
    assert per_layer == 2 * llama.num_kv_heads * llama.head_dim * 4


class _ShapeWatch(torch.utils._python_dispatch.TorchDispatchMode):
    """Every op's output shape while active."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


def _per_head_kv(shapes, ctx: int, m, block_size: int = 4) -> list:
    """Shapes that hold keys or values of `ctx` context tokens per head: a dimension of ctx (or of
    ctx padded to whole blocks, as the CPU path gathers) and a last dimension of a per-head K / V,
    or of kv_b_proj's expansion of every head."""
    h = m.num_heads
    per_head = {m.qk_nope_head_dim, m.v_head_dim, m.head_dim, h * (m.qk_nope_head_dim + m.v_head_dim),
                h * m.qk_nope_head_dim, h * m.v_head_dim, h * m.head_dim}
    lengths = {ctx, -(-ctx // block_size) * block_size}
    return [s for s in shapes if len(s) >= 2 and lengths & set(s[:-1]) and s[-1] in per_head]


def test_decode_never_materializes_per_head_kv(ds_engine):
    """A decode step at a context of 53 tokens: no intermediate tensor holds per-head keys or
    values of the context (watched at the dispatcher, every op), kv_b_proj is never applied to
    the cache, and the attention op receives the latent cache. The watch is checked to catch an
    expanded form (the prefill-style expansion of the same cache rows)."""
    from tritium.kernels import ops
    engine = LLMEngine(ds_engine("deepseek_v3", block_size=4), device="cpu", num_kv_blocks=32)
    model, m = engine.runner.model, engine.runner.cfg.model
    # 52 tokens: the decode step's context is 53, 56 padded to blocks of 4 (neither is a model dim)
    prompt = list(range(3, 55))
    engine.add_request("a", prompt_token_ids=prompt, params=SamplingParams(max_tokens=3, temperature=0.0))
    engine.step()  # prefill
    seen = []
    real = ops.mla_attention

    def spy(q, cache, meta, scale, rank):
        seen.append((tuple(q.shape), tuple(cache.shape), meta.max_query_len, meta.max_seq_len))
        return real(q, cache, meta, scale, rank)
    ops.mla_attention = spy
    try:
        with _ShapeWatch() as watch:
            engine.step()  # one decode token
    finally:
        ops.mla_attention = real
    assert seen and all(qs == (1, m.num_heads, m.kv_lora_rank + m.qk_rope_head_dim) and
                        cs[2:] == (1, m.kv_lora_rank + m.qk_rope_head_dim) and ql == 1 and sl == 53
                        for qs, cs, ql, sl in seen), seen
    assert len(seen) == m.num_layers
    assert not _per_head_kv(watch.shapes, 53, m), _per_head_kv(watch.shapes, 53, m)[:5]
    # the watch catches an expansion: kv_b_proj over the 53 cached latents, per head
    layer = model.layers[1]
    rows = engine.runner.kv_caches[1][0].reshape(-1, 48)[:53, :40]
    with _ShapeWatch() as control:
        torch.nn.functional.linear(rows, layer.kv_b_proj.weight).view(53, m.num_heads, -1)
    assert _per_head_kv(control.shapes, 53, m)


@pytest.mark.parametrize("mode", ["chunks", "preempt"])
def test_batched_rows_equal_alone(ds_engine, mode):
    """16 mixed rows, staggered: chunked prefill (5 tokens a step), and preemption (24 blocks of 4
    for rows of up to 11 blocks); every block freed at the end."""
    engine = LLMEngine(ds_engine("deepseek_v3", block_size=4), device="cpu", **MODES[mode])
    reqs, arrivals = workload(seed=31 + len(mode))
    outs = run_staggered(engine, reqs, arrivals)
    for (prompt, max_tokens), out in zip(reqs, outs):
        assert out.outputs[0].token_ids == alone(engine, prompt, max_tokens), (mode, len(prompt))
    st = engine.stats()
    assert mode != "preempt" or st["preemptions"] > 0
    assert st["kv_blocks_used"] == 0 and st["num_running"] == 0


def test_prefix_cache_reuses_latent_blocks(ds_engine):
    """A second V2 prompt sharing 3 blocks reads their latent rows from the cache and gets its own tokens."""
    engine = LLMEngine(ds_engine("deepseek_v2", block_size=4), device="cpu", num_kv_blocks=64)
    shared = [11 + 7 * i for i in range(12)]
    a, b = shared + [5, 6, 7], shared + [9, 10, 11, 12, 13]
    p = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.generate(prompt_token_ids=[a], params=p)
    (out_b,) = engine.generate(prompt_token_ids=[b], params=p)
    assert out_b.metrics["num_cached_tokens"] == 12
    assert out_b.outputs[0].token_ids == alone(engine, b, 8)


def test_ngram_speculation_equals_plain_greedy(ds_engine):
    """Verifying 3 proposed tokens puts 4 query rows of a decoding sequence through the latent
    attention at once; the tokens equal plain greedy decoding."""
    import random
    from tritium.backend.speculative.config import SpeculativeConfig
    spec = SpeculativeConfig("ngram", num_speculative_tokens=3, step_overhead_tokens=float("inf"))
    engine = LLMEngine(ds_engine("deepseek_v3", block_size=4), device="cpu", num_kv_blocks=128, speculative=spec)
    rng = random.Random(2)
    reqs = []
    for _ in range(4):
        seg = [rng.randrange(3, 1000) for _ in range(rng.randint(2, 5))]
        reqs.append(((seg * 4)[:20], rng.randint(4, 12)))
    outs = run_staggered(engine, reqs, [0, 0, 1, 2])
    for (prompt, max_tokens), out in zip(reqs, outs):
        assert out.outputs[0].token_ids == alone(engine, prompt, max_tokens)
    assert engine.stats()["spec_proposed_tokens"] > 0
