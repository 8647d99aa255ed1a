"""Tensor-parallel layout and sharding, checked against the definitions (no processes started).

Head split: every rank's query heads must read KV heads that the same rank holds (HF repeat_kv:
query head h reads KV head h // (num_heads / num_kv_heads)). Row-parallel shards must sum to the
full layer's output (Megatron-LM's row-parallel linear), including int4 with GPTQ's g_idx.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tritium.backend.config import EngineConfig, LayerQuant, ModelConfig, QuantConfig
from tritium.backend.parallel import step_message as msg
from tritium.backend.parallel_layout import TensorParallelError, head_ranges, local_config, plan_layout
from tritium.backend.step_arrays import StepArrays
from tritium.kernels.quant_layouts import dequantize_grouped, dequantize_int4, pack_int4
from tritium.builder.tp_shard import shard_engine_tensors


def _model(**kw):
    base = dict(architecture="llama", vocab_size=1000, hidden_size=96, intermediate_size=128, num_layers=1,
                num_heads=6, num_kv_heads=3, head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=256)
    base.update(kw)
    return ModelConfig(**base)


@pytest.mark.parametrize("heads,kv,n", [(9, 3, 2), (9, 3, 3), (9, 3, 9), (6, 3, 2), (4, 1, 2), (4, 1, 4),
                                        (32, 8, 8), (32, 8, 3), (8, 2, 4), (3, 3, 2)])
def test_every_query_head_finds_its_kv_head_on_its_rank(heads, kv, n):
    rep = heads // kv
    ranges = head_ranges(heads, kv, n)
    assert len(ranges) == n
    covered = []
    for (q0, q1), (k0, k1) in ranges:
        assert q1 > q0 and k1 > k0
        covered.extend(range(q0, q1))
        assert all(k0 <= h // rep < k1 for h in range(q0, q1))  # HF repeat_kv grouping
        # uniform grouping on the rank: local query head j reads local KV head j // local_rep
        local_rep = (q1 - q0) // (k1 - k0)
        assert (q1 - q0) % (k1 - k0) == 0
        assert all((h // rep) - k0 == (h - q0) // local_rep for h in range(q0, q1))
    assert covered == list(range(heads))  # each query head on exactly one rank


def test_smollm2_at_two_ranks_splits_whole_kv_groups():
    assert head_ranges(9, 3, 2) == [((0, 6), (0, 2)), ((6, 9), (2, 3))]


@pytest.mark.parametrize("heads,kv,n,needle", [(9, 3, 6, "split its 3 query heads"), (4, 1, 3, "multiple of 1"),
                                               (6, 3, 4, "multiple of num_kv_heads")])
def test_impossible_splits_say_why(heads, kv, n, needle):
    with pytest.raises(TensorParallelError, match=needle if needle != "multiple of 1" else "split its"):
        head_ranges(heads, kv, n)


def test_plan_layout_splits_mlp_in_group_units_and_vocab_evenly():
    lay = plan_layout(_model(intermediate_size=160, vocab_size=1001), 2, intermediate_unit=32)
    assert [r.intermediate for r in lay] == [96, 64]
    assert [r.vocab for r in lay] == [(0, 501), (501, 1001)]
    with pytest.raises(TensorParallelError, match="intermediate_size 100"):
        plan_layout(_model(intermediate_size=100), 2, intermediate_unit=32)


def test_step_message_round_trip():
    a = StepArrays(np.array([5, 6, 7], np.int64), np.array([0, 1, 9], np.int64), np.array([16, 17, 41], np.int64),
                   np.array([0, 2, 3], np.int32), np.array([2, 10], np.int32),
                   np.array([[1, 0], [2, 3]], np.int32), np.array([1, 2], np.int64), np.array([[4, 5]], np.int64))
    h = msg.header(msg.OP_STEP, a)
    p = msg.pack(a)
    assert len(p) == msg.payload_len(h)
    b = msg.unpack(h, p)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and np.array_equal(x, y)


def _cfg(layers):
    return EngineConfig(model=_model(), quantization=QuantConfig(method="int4-gptq", layers=layers))


def test_row_parallel_int4_with_g_idx_shards_sum_to_the_full_layer():
    """down_proj with act-order g_idx: each rank's shard (and the gate/up rows it keeps) must
    reproduce x W^T when the partial products are summed."""
    torch.manual_seed(0)
    m = _model()
    g, n_out, k = 32, m.hidden_size, m.intermediate_size
    q = torch.randint(0, 16, (n_out, k))
    scales = torch.rand(k // g, n_out) * 0.1 + 0.01
    zeros = torch.randn(k // g, n_out) * 0.1
    g_idx = torch.randperm(k) % (k // g)  # scattered groups, as act-order leaves them
    full = dequantize_int4(pack_int4(q), scales, zeros, g, g_idx.int(), torch.float32).double()
    gate_up = torch.randn(2 * k, m.hidden_size, dtype=torch.float64)
    tensors = {"layers.0.down_proj.qweight": pack_int4(q), "layers.0.down_proj.scales": scales,
               "layers.0.down_proj.zeros": zeros, "layers.0.down_proj.g_idx": g_idx.int(),
               "layers.0.gate_up_proj.weight": gate_up}
    cfg = _cfg({"layers.0.down_proj": LayerQuant("int4", group_size=g, act_order=True)})
    layout, shards = shard_engine_tensors(cfg, tensors, 2)
    x = torch.randn(5, m.hidden_size, dtype=torch.float64)  # float64: summation order does not matter
    h = x @ gate_up.t()
    act = torch.nn.functional.silu(h[:, :k]) * h[:, k:]
    ref = act @ full.t()
    total = torch.zeros_like(ref)
    for r, sh in enumerate(shards):
        kr = layout["ranks"][r]["intermediate"]
        assert sh["layers.0.down_proj.scales"].shape == (kr // g, n_out)
        w = dequantize_int4(sh["layers.0.down_proj.qweight"], sh["layers.0.down_proj.scales"],
                            sh["layers.0.down_proj.zeros"], g, sh["layers.0.down_proj.g_idx"], torch.float32).double()
        hr = x @ sh["layers.0.gate_up_proj.weight"].t()
        total += (torch.nn.functional.silu(hr[:, :kr]) * hr[:, kr:]) @ w.t()
    torch.testing.assert_close(total, ref, rtol=1e-10, atol=1e-10)


def test_int8_scales_follow_their_rows_and_kv_scales_their_heads():
    m = _model()
    torch.manual_seed(1)
    qkv_rows = (m.num_heads + 2 * m.num_kv_heads) * m.head_dim
    tensors = {"layers.0.qkv_proj.qweight": torch.randint(-127, 127, (qkv_rows, m.hidden_size), dtype=torch.int8),
               "layers.0.qkv_proj.scales": torch.arange(qkv_rows, dtype=torch.float32),
               "layers.0.o_proj.qweight": torch.randint(-127, 127, (m.hidden_size, 96), dtype=torch.int8),
               "layers.0.o_proj.scales": torch.rand(m.hidden_size),
               "layers.0.k_scale": torch.tensor([1.0, 2.0, 3.0]),
               "layers.0.v_offset": torch.arange(3 * 16, dtype=torch.float32).view(3, 16)}
    cfg = _cfg({"layers.0.qkv_proj": LayerQuant("int8"), "layers.0.o_proj": LayerQuant("int8")})
    layout, shards = shard_engine_tensors(cfg, tensors, 2)
    # rank 1 holds query heads 4, 5 and KV head 2 (6 query / 3 KV heads at two ranks)
    s1 = shards[1]
    expect_rows = list(range(64, 96)) + list(range(96 + 32, 96 + 48)) + list(range(96 + 48 + 32, 96 + 48 + 48))
    assert s1["layers.0.qkv_proj.scales"].tolist() == expect_rows
    assert torch.equal(s1["layers.0.qkv_proj.qweight"], tensors["layers.0.qkv_proj.qweight"][expect_rows])
    assert torch.equal(s1["layers.0.o_proj.scales"], tensors["layers.0.o_proj.scales"])  # all output channels
    assert torch.equal(s1["layers.0.o_proj.qweight"], tensors["layers.0.o_proj.qweight"][:, 64:96])
    assert s1["layers.0.k_scale"].tolist() == [3.0] and shards[0]["layers.0.k_scale"].tolist() == [1.0, 2.0]
    assert torch.equal(s1["layers.0.v_offset"], tensors["layers.0.v_offset"][2:3])


def test_int4_group_crossing_a_rank_boundary_is_refused():
    m = _model()
    g = 64  # o_proj inputs 96 = 64 (rank 0) + 32 (rank 1): a group of 64 cannot be whole on rank 1
    tensors = {"layers.0.o_proj.qweight": pack_int4(torch.randint(0, 16, (m.hidden_size, 96))),
               "layers.0.o_proj.scales": torch.rand(96 // 32, m.hidden_size)[:1],
               "layers.0.o_proj.zeros": torch.rand(1, m.hidden_size)}
    cfg = _cfg({"layers.0.o_proj": LayerQuant("int4", group_size=g)})
    with pytest.raises(TensorParallelError, match="layers.0.o_proj: quantization group .* would be split"):
        shard_engine_tensors(cfg, tensors, 2)


def test_local_config_and_engine_json_layout_round_trip():
    m = _model()
    layout, _ = shard_engine_tensors(EngineConfig(model=m), {}, 2)
    cfg = EngineConfig(model=m, tensor_parallel_size=2, tensor_parallel=layout)
    back = EngineConfig.from_dict(cfg.to_dict())
    assert back.tensor_parallel == cfg.tensor_parallel
    loc = local_config(back, 1)
    assert (loc.model.num_heads, loc.model.num_kv_heads, loc.model.intermediate_size, loc.model.vocab_size) == \
        (2, 1, 64, 500)
    bad = cfg.to_dict()
    bad["tensor_parallel"]["ranks"] = bad["tensor_parallel"]["ranks"][:1]
    from tritium.backend.config import EngineFormatError
    with pytest.raises(EngineFormatError, match="tensor_parallel.ranks must list 2 ranks"):
        EngineConfig.from_dict(bad)


@pytest.mark.parametrize("asymmetric", [False, True])
def test_grouped_int8_shards_sum_to_the_full_layer(asymmetric):
    """Grouped int8 (scales / zeros (K/G, N)): column-parallel qkv keeps its output columns of
    the scales, row-parallel o_proj and down_proj keep whole groups; summed over ranks the
    row-parallel partial products equal the full layer, and each rank's column slice is exact."""
    torch.manual_seed(2)
    m = _model()
    g = 16
    qkv_rows = (m.num_heads + 2 * m.num_kv_heads) * m.head_dim
    k_o, k_d = m.num_heads * m.head_dim, m.intermediate_size

    def layer(n, k):
        q = torch.randint(-128, 128, (n, k), dtype=torch.int8)
        s = torch.rand(k // g, n) * 0.1 + 0.01
        z = torch.randn(k // g, n) * 0.1 if asymmetric else None
        return q, s, z

    tensors, full = {}, {}
    for lin, (n, k) in {"qkv_proj": (qkv_rows, m.hidden_size), "o_proj": (m.hidden_size, k_o),
                        "down_proj": (m.hidden_size, k_d)}.items():
        q, s, z = layer(n, k)
        tensors.update({f"layers.0.{lin}.qweight": q, f"layers.0.{lin}.scales": s})
        if z is not None:
            tensors[f"layers.0.{lin}.zeros"] = z
        full[lin] = dequantize_grouped(q, s, z, g).double()
    tensors["layers.0.gate_up_proj.weight"] = torch.randn(2 * k_d, m.hidden_size)
    lq = LayerQuant("int8", group_size=g, asymmetric=asymmetric)
    cfg = _cfg({f"layers.0.{lin}": lq for lin in ("qkv_proj", "o_proj", "down_proj")})
    layout, shards = shard_engine_tensors(cfg, tensors, 2)
    x = torch.randn(5, k_o, dtype=torch.float64)
    xd = torch.randn(5, k_d, dtype=torch.float64)
    tot_o, tot_d = torch.zeros(5, m.hidden_size, dtype=torch.float64), torch.zeros(5, m.hidden_size, dtype=torch.float64)
    o0, d0 = 0, 0
    for r, sh in enumerate(shards):
        lay = layout["ranks"][r]
        ko, kd = (lay["q_heads"][1] - lay["q_heads"][0]) * m.head_dim, lay["intermediate"]
        p = "layers.0."
        for lin, kk in (("o_proj", ko), ("down_proj", kd)):
            assert sh[p + lin + ".scales"].shape == (kk // g, m.hidden_size)
            assert (p + lin + ".zeros" in sh) == asymmetric
        wo = dequantize_grouped(sh[p + "o_proj.qweight"], sh[p + "o_proj.scales"], sh.get(p + "o_proj.zeros"), g)
        wd = dequantize_grouped(sh[p + "down_proj.qweight"], sh[p + "down_proj.scales"],
                                sh.get(p + "down_proj.zeros"), g)
        tot_o += x[:, o0:o0 + ko] @ wo.double().t()
        tot_d += xd[:, d0:d0 + kd] @ wd.double().t()
        o0, d0 = o0 + ko, d0 + kd
        # column-parallel: this rank's rows of the full dequantized qkv, exactly
        wq = dequantize_grouped(sh[p + "qkv_proj.qweight"], sh[p + "qkv_proj.scales"], sh.get(p + "qkv_proj.zeros"), g)
        assert sh[p + "qkv_proj.scales"].shape == (m.hidden_size // g, wq.shape[0])
        q0, q1 = lay["q_heads"]
        assert torch.equal(wq[: (q1 - q0) * m.head_dim].double(), full["qkv_proj"][q0 * m.head_dim:q1 * m.head_dim])
    torch.testing.assert_close(tot_o, x @ full["o_proj"].t(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(tot_d, xd @ full["down_proj"].t(), rtol=1e-10, atol=1e-10)


def test_grouped_int8_group_crossing_a_rank_boundary_is_refused():
    m = _model()
    tensors = {"layers.0.o_proj.qweight": torch.zeros(m.hidden_size, 96, dtype=torch.int8),
               "layers.0.o_proj.scales": torch.rand(96 // 64 + 1, m.hidden_size)}
    cfg = _cfg({"layers.0.o_proj": LayerQuant("int8", group_size=64)})
    with pytest.raises(TensorParallelError, match="layers.0.o_proj: quantization group .* would be split"):
        shard_engine_tensors(cfg, tensors, 2)


def test_grouped_int8_down_proj_sets_the_intermediate_split_unit():
    # intermediate 128 over 3 ranks: 43/43/42 unconstrained, whole groups of 32 give 64/32/32
    cfg = _cfg({"layers.0.down_proj": LayerQuant("int8", group_size=32)})
    layout, _ = shard_engine_tensors(cfg, {}, 3)
    assert [r["intermediate"] for r in layout["ranks"]] == [64, 32, 32]
