"""DeepSeek-V3 and DeepSeek-V2 (V2-Lite's layout): multi-head latent attention (backend/models/mla.py)
and DeepSeek's routing (backend/models/moe_routing.py) against Hugging Face transformers on tiny
random checkpoints: fp32 logits within 1e-4 relative (L2) error and greedy tokens equal to
`generate`; the routers against transformers' own router modules; the latent cache's size per
token (the build report and the runner's pool) equal to (kv_lora_rank + qk_rope_head_dim) x dtype
bytes per layer; a decode step that never forms per-head K or V (every intermediate tensor
watched); batched == alone with chunked prefill, preemption and prefix reuse; TP = 2 == TP = 1;
int8 / int4 (RTN) experts; configs the engine cannot honour refused naming the field."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import tiny_models
from hf_oracle import PROMPTS, hf_model, rel_err
from simple_generate import generate_simple, prompt_logits
from test_models_engine import MODES, alone, run_staggered, workload
from tp_utils import record_logits, tp_timeout, wait_no_workers  # noqa: F401 (fixture)
from tritium.backend.engine import LLMEngine
from tritium.backend.loader import load_engine
from tritium.backend.sampling_params import SamplingParams
from tritium.builder.convert import CheckpointError
from tritium.builder.hf_loader import model_config_from_hf

pytestmark = pytest.mark.usefixtures("one_thread")

_V3 = dict(model_type="deepseek_v3", hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
           num_hidden_layers=3, num_attention_heads=4, vocab_size=1000, max_position_embeddings=256,
           n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, first_k_dense_replace=1,
           n_shared_experts=1, kv_lora_rank=40, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16,
           v_head_dim=32, routed_scaling_factor=2.5, tie_word_embeddings=False)
_V2 = dict(model_type="deepseek_v2", hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
           num_hidden_layers=2, num_attention_heads=4, vocab_size=1000, max_position_embeddings=256,
           n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1, n_shared_experts=2,
           kv_lora_rank=40, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=32,
           routed_scaling_factor=1.5, tie_word_embeddings=False)
tiny_models.FAMILIES.update({
    # V3: q_lora_rank set, a dense first layer, 1 shared expert, sigmoid scores with a correction
    # bias (set below), top-3 among the 2 best of 4 groups, routed_scaling_factor 2.5
    "deepseek_v3": _V3,
    # ... with YaRN (factor 4, mscale != mscale_all_dim: attention factor and softmax-scale correction)
    "deepseek_v3_yarn": dict(_V3, rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                                       original_max_position_embeddings=64, beta_fast=32,
                                                       beta_slow=1, mscale=1.0, mscale_all_dim=0.8)),
    # V2-Lite's layout: q_proj (no q_lora_rank), softmax greedy top-2, 2 shared experts
    "deepseek_v2": _V2,
    # V2's group_limited_greedy: top-2 among the 2 best of 4 groups (by their best expert)
    "deepseek_v2_grouped": dict(_V2, topk_method="group_limited_greedy", n_group=4, topk_group=2),
})
FAMILIES = ["deepseek_v3", "deepseek_v3_yarn", "deepseek_v2", "deepseek_v2_grouped"]


def _with_bias(path: str) -> str:
    """transformers initializes e_score_correction_bias to zeros; a random one makes the choice
    differ from the weights (set in the checkpoint itself, so both sides read it)."""
    f = os.path.join(path, "model.safetensors")
    t = load_file(f)
    names = [k for k in t if k.endswith("e_score_correction_bias")]
    if names and all(not t[k].any() for k in names):
        g = torch.Generator().manual_seed(3)
        for k in names:
            t[k] = torch.randn(t[k].shape, generator=g) * 0.3
        save_file(t, f, metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def ds_checkpoint(tiny_checkpoint):
    return lambda family, **over: _with_bias(tiny_checkpoint(family, **over))


@pytest.fixture(scope="module")
def ds_engine(ds_checkpoint, tiny_engine):
    def make(family, dtype="float32", **kw):
        ds_checkpoint(family)  # the bias in place before the (cached) build reads the checkpoint
        return tiny_engine(family, dtype, **kw)
    return make


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
    m = model_config_from_hf(dict(_V3, **over))
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


@pytest.mark.usefixtures("tp_timeout")
def test_tp2_heads_and_experts_split_equals_tp1(ds_engine):
    """TP = 2 (MLA heads split by head: q / q_b_proj rows, kv_b_proj rows, o_proj columns; the
    latent replicated; experts and shared experts split by columns; routers replicated) == TP = 1,
    for DeepSeek-V3 (q_b_proj; V2-Lite's q_proj takes the same row split)."""
    from safetensors import safe_open
    family = "deepseek_v3"
    prompts = [PROMPTS[0], PROMPTS[1]]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    runs = []
    for tp in (1, 2):
        path = ds_engine(family, "float32", **({"tensor_parallel_size": 2} if tp == 2 else {}))
        kw = {"threads_per_rank": 1} if tp == 2 else {}
        with LLMEngine(path, device="cpu", num_kv_blocks=64, **kw) as e:
            logs = record_logits(e)
            outs = e.generate(prompt_token_ids=prompts, params=greedy)
            runs.append(([o.outputs[0].token_ids for o in outs], logs))
        if tp == 2:
            assert not wait_no_workers(path), "a worker outlived close()"
            with safe_open(f"{path}/rank1.safetensors", "pt") as f:
                assert tuple(f.get_tensor("layers.1.kv_b_proj.weight").shape) == (2 * (16 + 32), 40)
                assert tuple(f.get_tensor("layers.1.o_proj.weight").shape) == (64, 2 * 32)
                assert tuple(f.get_tensor("layers.1.kv_a_proj.weight").shape) == (48, 64)
    (tok1, log1), (tok2, log2) = runs
    assert tok2 == tok1
    assert len(log2) == len(log1) and all(rel_err(a, b) < 1e-4 for a, b in zip(log2, log1))


@pytest.mark.parametrize("method", ["int8", "int4-rtn", "int4-gptq", "fp8"])
def test_quantized_experts_serve_their_dequantized_weights(method, ds_engine):
    """A V3 engine with int8 / int4 (RTN, or GPTQ per expert on the tokens its sigmoid,
    group-limited router sends it) / fp8 experts (and o_proj / dense MLP quantized; the MLA
    projections float): the logits equal those of the engine holding the dequantized experts."""
    import dataclasses
    from test_models_moe import _dequantized
    from tritium.backend.models.decoder import DecoderLM
    path = ds_engine("deepseek_v3", quantization=method, eval_tokens=0, calibration_samples=4)
    cfg, model, _ = load_engine(path, "cpu")
    tensors = load_file(f"{path}/rank0.safetensors")
    kind = method.split("-")[0]
    assert cfg.quantization.layers["layers.1.experts.gate_up"].method == kind
    assert "layers.1.experts.down_weight" not in tensors and "layers.0.gate_up_proj.qweight" in tensors
    assert "layers.1.kv_b_proj.weight" in tensors and "layers.1.qkv_proj" not in cfg.quantization.layers
    deq = _dequantized(cfg, tensors)
    layers = {k: v for k, v in cfg.quantization.layers.items() if ".experts." not in k}
    ref_model = DecoderLM(dataclasses.replace(cfg, quantization=dataclasses.replace(cfg.quantization, layers=layers)))
    ref_model.load_engine_weights({**{k: v for k, v in tensors.items() if ".experts." not in k},
                                   **{k: v for k, v in deq.items() if ".experts." in k}})
    # the dense linears' activations as the engine's (int8 / int4 builds: W8A8 / W4A8 by default)
    from tritium.backend.quant import set_activation_quant
    set_activation_quant(ref_model, cfg.activation_quant)
    for ids in PROMPTS[:2]:
        got, ref = prompt_logits(model, ids), prompt_logits(ref_model.eval(), ids)
        assert rel_err(got, ref) < 1e-5, (method, rel_err(got, ref))


CLI = [sys.executable, "-m", "tritium.client.cli"]
BAD = {"v3 scoring_func": (_V3, dict(scoring_func="softmax"), ["scoring_func", "'softmax'", "sigmoid"]),
       "v3 topk_method": (_V3, dict(topk_method="greedy"), ["topk_method", "'greedy'", "noaux_tc"]),
       "v2 topk_method": (_V2, dict(topk_method="noaux_tc"), ["topk_method", "'noaux_tc'", "group_limited_greedy"]),
       "v2 norm_topk_prob": (_V2, dict(norm_topk_prob=True), ["norm_topk_prob"]),
       "n_group": (_V3, dict(n_group=3), ["n_group 3"]),
       "attention_bias": (_V3, dict(attention_bias=True), ["attention_bias"]),
       "rope_interleave": (_V3, dict(rope_interleave=False), ["rope_interleave", "False"])}


@pytest.mark.parametrize("case", list(BAD))
def test_unhonourable_config_is_refused_naming_it(case):
    base, edit, needles = BAD[case]
    with pytest.raises(CheckpointError) as e:
        model_config_from_hf(dict(base, **edit))
    assert all(n in str(e.value) for n in needles), str(e.value)


def test_cli_build_refusal_is_one_line_exit_2(ds_checkpoint, tmp_path):
    src = ds_checkpoint("deepseek_v3")
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    cfg = json.load(open(f"{src}/config.json"))
    (dst / "config.json").write_text(json.dumps(dict(cfg, topk_method="greedy")))
    r = subprocess.run(CLI + ["build", str(dst), "-o", str(tmp_path / "e")], capture_output=True, text=True)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "topk_method 'greedy'" in r.stderr and not (tmp_path / "e" / "engine.json").exists(), r.stderr


def test_quantized_kv_cache_refused_before_any_work(ds_checkpoint, tmp_path):
    from tritium.builder.build import BuildOptions, build_engine
    with pytest.raises(ValueError, match="--kv-cache-dtype int8: the latent cache"):
        build_engine(BuildOptions(source=ds_checkpoint("deepseek_v3"), output=str(tmp_path / "e"),
                                  kv_cache_dtype="int8", progress=False))
    assert not (tmp_path / "e").exists()


@pytest.mark.parametrize("field,value,needle", [("router_topk", "top2", "model.router_topk 'top2'"),
                                                ("n_group", 3, "model.n_group 3"),
                                                ("head_dim", 20, "head_dim 20"),
                                                ("v_head_dim", 0, "model.v_head_dim"),
                                                ("kv_lora_rank", -8, "model.kv_lora_rank must be an integer >= 0")])
def test_engine_json_mla_fields_checked_at_load(field, value, needle, ds_engine):
    from tritium.backend.config import EngineConfig, EngineFormatError
    d = json.load(open(f"{ds_engine('deepseek_v3')}/engine.json"))
    d["model"][field] = value
    with pytest.raises(EngineFormatError) as e:
        EngineConfig.from_dict(d)
    assert needle in str(e.value), str(e.value)


def test_deepseek_v3_serves_through_tritonserver(ds_engine, tmp_path):
    """A DeepSeek-V3 engine behind the real tritonserver: greedy tokens over gRPC equal the
    in-process engine's, for a prompt and then a second one sharing its prefix (latent blocks reused)."""
    from tritium.builder.repository import write_repository
    from tritium.client.serve.server import TritonServer, prepare_backend_dir
    from tritium.client.triton_client import TritiumClient
    path = ds_engine("deepseek_v3")
    repo = str(tmp_path / "repo")
    write_repository(repo, "ds", path, engine_params={"num_kv_blocks": "64", "num_threads": "1",
                                                     "small_step_threads": "1"})
    srv = TritonServer(repo, log_file=str(tmp_path / "server.log"), load_models=["ds"],
                       backend_dir=prepare_backend_dir(str(tmp_path / "backends")))
    srv.start(timeout=300)
    try:
        client = TritiumClient(srv.grpc_url, protocol="grpc", model="ds", timeout=120)
        ref_engine = LLMEngine(path, device="cpu", num_kv_blocks=64)
        for text in ("Latent attention caches one row", "Latent attention caches one row per token"):
            ref = ref_engine.generate([text], SamplingParams(max_tokens=8, min_tokens=8, temperature=0.0))[0]
            got = client.generate(text, max_tokens=8, min_tokens=8, temperature=0.0)
            assert got.token_ids == ref.outputs[0].token_ids, text
    finally:
        srv.stop()
