"""The integer-dot LM head on int6 codes (kernels/cpu_head.c, kernels/head_pack.py), every ISA path.

Oracles: the int6 layout as stored (quant_layouts.pack_int6, whose bit layout test_embedding_int6.py
checks against the documented formula), the W6A8 product written here from its definition (int8
activations per row and block of 32: d = amax / 127, codes rounded half to even; exact integer
block dots times both scales) in float64, and float32 torch x @ W^T of the dequantized weight.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from tritium.builder.build import BuildOptions, build_engine
from tritium.kernels import cpu_native, head_pack, i8dot_pack
from tritium.kernels.quant_layouts import dequantize_int6, pack_int6, unpack_int6


def _weights(n, k, group, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-32, 32, (n, k), generator=g)
    q[0, :2] = torch.tensor([-32, 31])
    if group is None:
        s = (torch.rand(n, generator=g) * 0.02 + 1e-3).to(torch.bfloat16)
    else:
        s = (torch.rand(k // group, n, generator=g) * 0.02 + 1e-3).half()
    return pack_int6(q), s


def _w6a8_by_definition(x, stored, s, group):
    """float64 (M, N) from the documented formulas, independent of head_pack."""
    m, k = x.shape
    xb = x.to(torch.bfloat16).float().view(m, k // 32, 32)
    amax = xb.abs().amax(dim=2)
    inv = torch.full_like(amax, 127.0) / amax  # a float32 division (127.0 / t is 127 * (1 / t) in torch)
    xq = torch.round(xb * torch.where(amax > 0, inv, torch.zeros_like(amax))[:, :, None]).clamp(-127, 127)
    xd = (amax / 127.0).double()
    c = unpack_int6(stored).long()  # (N, K)
    n = c.shape[0]
    t = torch.einsum("mbi,nbi->mnb", xq.long(), c.view(n, k // 32, 32)).double()
    sw = (s.double()[:, None].expand(n, k // 32) if group is None
          else s.double().t().repeat_interleave(group // 32, dim=1))
    return (t * xd[:, None, :] * sw[None]).sum(dim=2)


@pytest.mark.parametrize("n, k, group", [(1000, 576, 64), (37, 96, None), (200, 128, 32), (16, 64, 64)])
def test_head6_matches_the_definition_and_float32_on_each_path(cpu_path, n, k, group):
    stored, s = _weights(n, k, group)
    hw = head_pack.repack6(unpack_int6(stored), s, group)
    x = torch.randn(9, k).to(torch.bfloat16)
    x[3] = 0.0  # an all-zero row: codes 0, scale 0
    y = cpu_native.head6_gemm(x, hw)
    ref = _w6a8_by_definition(x, stored, s, group)
    assert y.shape == (9, n) and y.dtype == torch.float32
    err = (y.double() - ref).abs().max().item()
    assert err <= 1e-5 * ref.abs().max().item(), (cpu_path, err)
    assert bool((y[3] == 0).all())
    w = dequantize_int6(stored, s, group)  # float32 reference of the stored matrix
    f32 = x.float() @ w.t()
    rel = ((y - f32).norm() / f32.norm()).item()
    assert rel < 2e-2, (cpu_path, rel)  # int8 activations: about 1% relative


def test_head6_rows_alone_equal_the_batch_and_threads_split_the_vocabulary(cpu_path):
    """Batch invariance: a row's logits are the same bits alone, in any batch (1..17 rows: the
    8-row tiles and their remainders) and on 1 or 2 threads (the vocabulary split across them)."""
    stored, s = _weights(1000, 576, 64, seed=2)
    hw = head_pack.repack6(unpack_int6(stored), s, 64)
    x = torch.randn(17, 576).to(torch.bfloat16)
    n0 = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        full = cpu_native.head6_gemm(x, hw)
        torch.set_num_threads(2)
        assert torch.equal(cpu_native.head6_gemm(x, hw), full), cpu_path
    finally:
        torch.set_num_threads(n0)
    for i in range(17):
        assert torch.equal(cpu_native.head6_gemm(x[i:i + 1], hw), full[i:i + 1]), (cpu_path, i)
    assert torch.equal(cpu_native.head6_gemm(x[5:14], hw), full[5:14]), cpu_path


def test_head6_gives_the_bits_of_the_int8_integer_dot_kernel_on_the_widened_codes(cpu_path):
    """The documented contract: the 6-bit head computes what tritium_i8dot_gemm computes on the
    same codes widened to int8 (the old path of int6 heads under activation_quant int8)."""
    for group in (64, None):
        stored, s = _weights(300, 192, group, seed=5)
        codes = unpack_int6(stored)
        x = torch.randn(11, 192).to(torch.bfloat16)
        y6 = cpu_native.head6_gemm(x, head_pack.repack6(codes, s, group))
        y8 = cpu_native.i8dot_gemm(x, i8dot_pack.repack(codes, s, None, group, 8))
        assert torch.equal(y6, y8), (cpu_path, group)


@pytest.mark.parametrize("m", [8, 9, 13, 16, 23, 33])
def test_head6_row_counts_of_the_two_tile_pass_keep_the_widened_bits_and_each_rows_own(cpu_path, m):
    """Row counts around the tiles (avx512: up to 16 rows in one pass over a panel, the codes
    rebuilt once for both 8-row tiles; a remainder of 1-8 rows in the 8-row tile): the bits of the
    int8 kernel on the widened codes, and each row alone gives its row of the batch."""
    stored, s = _weights(70, 160, 32, seed=11 + m)
    codes = unpack_int6(stored)
    hw = head_pack.repack6(codes, s, 32)
    x = torch.randn(m, 160).to(torch.bfloat16)
    y = cpu_native.head6_gemm(x, hw)
    assert torch.equal(y, cpu_native.i8dot_gemm(x, i8dot_pack.repack(codes, s, None, 32, 8))), (cpu_path, m)
    ref = _w6a8_by_definition(x, stored, s, 32)
    assert (y.double() - ref).abs().max().item() <= 1e-5 * ref.abs().max().item(), (cpu_path, m)
    for i in (0, m // 2, m - 1):
        assert torch.equal(cpu_native.head6_gemm(x[i:i + 1], hw), y[i:i + 1]), (cpu_path, m, i)


def test_head6_lookup_reads_the_same_codes(cpu_path):
    stored, s = _weights(1000, 576, 64, seed=7)
    codes = unpack_int6(stored)
    hw = head_pack.repack6(codes, s, 64)
    assert hw.codes.numel() == 63 * 16 * 576 * 6 // 8  # 6 bits per weight (vocabulary padded to 1008)
    ids = torch.tensor([0, 999, 17, 16, 15, 500, 17])
    assert torch.equal(cpu_native.head6_rows(hw, ids), codes[ids])
    assert torch.equal(head_pack.signed_codes(hw), codes)
    assert torch.equal(head_pack.scales(hw), s.float().t().repeat_interleave(1, dim=1))
    with pytest.raises(IndexError, match=r"\[0, 1000\)"):
        cpu_native.head6_rows(hw, torch.tensor([1000]))


def test_head6_repack_refuses_bad_codes_and_shapes():
    with pytest.raises(ValueError, match=r"\[-32, 31\]"):
        head_pack.repack6(torch.full((4, 64), 32), torch.ones(4), None)
    with pytest.raises(ValueError, match="multiples of 32"):
        head_pack.repack6(torch.zeros(4, 48, dtype=torch.int64), torch.ones(4), None)
    with pytest.raises(ValueError, match=r"group scales must be \(2, 4\)"):
        head_pack.repack6(torch.zeros(4, 64, dtype=torch.int64), torch.ones(4), 32)


def test_head_dot_environment_variable_is_checked(monkeypatch):
    from tritium.kernels import cpu_linear
    monkeypatch.setenv("TRITIUM_HEAD_DOT", "2")
    with pytest.raises(ValueError, match="TRITIUM_HEAD_DOT must be 0 or 1"):
        cpu_linear.head_dot_enabled()


@pytest.fixture(scope="module")
def tp_engines(tiny_checkpoint, tmp_path_factory):
    src = tiny_checkpoint("llama", hidden_size=128, intermediate_size=96, num_attention_heads=4,
                          num_key_value_heads=2)
    out = {}
    for tp in (1, 2):  # int4 groups of 32: o_proj's 64 inputs split in two
        out[tp] = str(tmp_path_factory.mktemp("head6") / f"tp{tp}")
        build_engine(BuildOptions(source=src, output=out[tp], dtype="bfloat16", quantization="int4-rtn",
                                  group_size=32, embedding_quantization="int6", tensor_parallel_size=tp,
                                  progress=False, eval_tokens=0))
    return out


def test_tensor_parallel_vocabulary_shards_give_the_full_heads_columns(tp_engines, native_cpu):
    """Each rank's head (its vocabulary rows, a shard whose size need not be a multiple of 16)
    gives the whole engine's logits of those rows bit for bit, and its lookup the same rows."""
    from tritium.backend.loader import load_engine
    _, full, _ = load_engine(tp_engines[1], "cpu")
    with open(os.path.join(tp_engines[2], "engine.json")) as f:
        layout = json.load(f)["tensor_parallel"]
    h = torch.randn(5, 128).to(torch.bfloat16)
    head = full.lm_head or full.embed_tokens
    assert head._get_packed().kind == "head6"
    y = head(h).float()
    covered = 0
    for r in range(2):
        _, part, _ = load_engine(tp_engines[2], "cpu", rank=r)
        v0, v1 = layout["ranks"][r]["vocab"]
        ph = part.lm_head or part.embed_tokens
        assert ph._get_packed().kind == "head6" and ph.out_features == v1 - v0
        assert torch.equal(ph(h).float(), y[:, v0:v1]), r
        ids = torch.tensor([0, v1 - v0 - 1, (v1 - v0) // 2])
        assert torch.equal(part.embed_tokens.codes(ids), full.embed_tokens.codes(ids + v0)), r
        covered += v1 - v0
    assert covered == full.cfg.model.vocab_size


def _tied(tiny_checkpoint, out: str, quantization: str) -> str:
    src = tiny_checkpoint("llama", hidden_size=128, intermediate_size=96, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=32, tie_word_embeddings=True)  # the native step's sizes
    # weight-only linears (activation_quant none): the head's own default, TRITIUM_HEAD_DOT, decides
    # its kernel (with the build default int8 every linear, the head too, runs integer-dot)
    build_engine(BuildOptions(source=src, output=out, dtype="bfloat16", quantization=quantization,
                              activation_quant="none", progress=False, eval_tokens=0))  # embedding: int6 g64 / int8 g32
    return out


@pytest.fixture(scope="module")
def tied_engine(tiny_checkpoint, tmp_path_factory):
    return _tied(tiny_checkpoint, str(tmp_path_factory.mktemp("tied") / "e"), "int4-rtn")


@pytest.mark.parametrize("quantization", ["int4-rtn", "int8"])
def test_tied_head_holds_the_codes_once_and_the_lookup_reads_them(tiny_checkpoint, tied_engine, tmp_path,
                                                                  monkeypatch, native_cpu, quantization):
    """A tied int6 / int8 embedding packed as the integer-dot head (W6A8 / W8A8): qweight is dropped
    (the panels are the one copy), the lookup reads its rows from the panels and equals the stored
    layout's dequantized rows; switching the head to weight-only (TRITIUM_HEAD_DOT=0) brings the
    stored codes back bit for bit."""
    from tritium.backend.loader import load_engine
    from tritium.kernels.quant_layouts import dequantize_grouped
    from safetensors.torch import load_file
    out = tied_engine if quantization == "int4-rtn" else _tied(tiny_checkpoint, str(tmp_path / "e8"), quantization)
    cfg, model, _ = load_engine(out, "cpu")
    assert cfg.model.tie_word_embeddings and model.lm_head is None
    t = load_file(os.path.join(out, "rank0.safetensors"))
    e = model.embed_tokens
    assert e._get_packed().kind == ("head6" if quantization == "int4-rtn" else "i8dot") and e.qweight.numel() == 0
    ids = torch.tensor([0, 999, 5, 16, 17, 640, 5])
    if quantization == "int4-rtn":
        emb = dequantize_int6(t["embed_tokens.qweight"], t["embed_tokens.scales"], 64)
    else:
        emb = dequantize_grouped(t["embed_tokens.qweight"], t["embed_tokens.scales"], None, 32)
    assert torch.equal(model.embed(ids), emb[ids].to(torch.bfloat16))
    for few in ([999], [0, 17], [640, 5, 5, 16]):  # a decode step's few rows: the row-by-row gather
        few = torch.tensor(few, dtype=torch.int64)
        assert torch.equal(model.embed(few), emb[few].to(torch.bfloat16)), few
    if quantization == "int8":
        assert e.codes(torch.tensor([], dtype=torch.int64)).shape == (0, e.in_features)
        for bad in ([cfg.model.vocab_size], [3, -1]):
            with pytest.raises(IndexError, match=r"ids must lie in \[0, "):
                e.codes(torch.tensor(bad))
    h = torch.randn(3, 128).to(torch.bfloat16)
    y = model.compute_logits(h)
    ref = h.float() @ emb.t()
    assert ((y - ref).norm() / ref.norm()).item() < 2e-2
    monkeypatch.setenv("TRITIUM_HEAD_DOT", "0")
    e._packed = None  # as set_activation_quant does on a mode change
    assert e._get_packed().kind not in ("head6", "i8dot")
    assert torch.equal(e.qweight, t["embed_tokens.qweight"])  # the stored codes, rebuilt exactly
    assert torch.equal(model.embed(ids), emb[ids].to(torch.bfloat16))
    yw = model.compute_logits(h)
    assert ((yw - ref).norm() / ref.norm()).item() < 1e-2 and not torch.equal(yw, y)


def test_head_benchmarks_print_their_figures(tied_engine, capsys, native_cpu):
    """The benchmarks run and print one figure per kernel / head (not timed: figures only)."""
    from tritium.client.bench import head_bench, native_step_bench
    assert head_bench.main(["--vocab", "100", "--hidden", "64", "--rows", "1,3", "--reps", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count(" ms ") == 6 and "W6A8 (cpu_head.c)" in out
    assert native_step_bench.main([tied_engine, "--batch", "1", "--tokens", "4", "--rounds", "1", "--head",
                                   "--bandwidth-gbs", "10"]) == 0
    out = capsys.readouterr().out
    assert "head head6:" in out and "(TRITIUM_HEAD_DOT=0)" in out and "ratio" in out
    assert os.environ.get("TRITIUM_HEAD_DOT") is None  # restored
