"""Hadamard rotation of a quantized KV cache (kv_cache.rotation = "hadamard"; QuaRot): exact in
real arithmetic, and with FP8 storage it shrinks the score error that outlier channels shared
by q and k cause."""
import pytest
import torch

from tritium.kernels.attention_metadata import AttentionMetadata
from tritium.backend.config import EngineConfig, EngineFormatError
from tritium.backend.loader import load_engine
from tritium.backend.models.kv_rotation import hadamard, rotate, rotation_supported
from tritium.builder.quant import quant_pipeline as qp
from tritium.builder.quant.kv_scales import kv_head_scales
from tritium.kernels.kv_write_ref import quantize_kv_ref
from tritium.kernels.attention_ref import paged_attention_ref

from test_kv_offset import chunked_then_decode_logits


@pytest.mark.parametrize("n", [1, 2, 16, 64])
def test_hadamard_is_sylvester_and_orthonormal(n):
    h = hadamard(n).double()
    # closed form of Sylvester's matrix: H[i, j] = (-1)^popcount(i & j) / sqrt(n)
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    bits = torch.zeros(n, n, dtype=torch.long)
    for b in range(max(n.bit_length(), 1)):
        bits += ((i & j) >> b) & 1
    want = (1 - 2 * (bits % 2)).double() / n ** 0.5
    torch.testing.assert_close(h, want)
    torch.testing.assert_close(h @ h, torch.eye(n, dtype=torch.float64), rtol=0, atol=1e-6)


def test_rotation_needs_a_power_of_two():
    assert rotation_supported(64) and not rotation_supported(18)
    with pytest.raises(ValueError, match="power of two"):
        hadamard(24)


def test_rotation_leaves_float_attention_unchanged(tiny_engine):
    """Prefill and decode with the rotation on give the same logits; the cache really holds K H, V H."""
    _, model, _ = load_engine(tiny_engine("llama"), "cpu")
    ids = [3, 17, 42, 7, 99, 5, 12, 64, 33, 8, 21]
    ref, ref_kv = chunked_then_decode_logits(model, ids, 6)
    for layer in model.layers:
        layer.kv_rotation = True
    got, got_kv = chunked_then_decode_logits(model, ids, 6)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    m = model.cfg.model
    for ref_pair, got_pair in zip(ref_kv, got_kv):
        for c_ref, c_got in zip(ref_pair, got_pair):
            flat_ref = c_ref.reshape(-1, m.num_kv_heads, m.head_dim)[:len(ids)]
            flat_got = c_got.reshape(-1, m.num_kv_heads, m.head_dim)[:len(ids)]
            torch.testing.assert_close(flat_got, flat_ref @ hadamard(m.head_dim), rtol=1e-5, atol=1e-5)


def test_rotation_cuts_fp8_score_error_of_shared_outlier_channels():
    torch.manual_seed(3)
    hq, hkv, d, bs, n = 2, 1, 64, 8, 64
    # q and k both large (and varying, so an offset cannot remove it) in two channels.
    k = torch.randn(n, hkv, d)
    k[:, :, :2] *= 12.0
    q = torch.randn(4, hq, d)
    q[:, :, :2] *= 12.0
    v = torch.randn(n, hkv, d)
    nb = n // bs
    meta = AttentionMetadata.build([4], [n], [list(range(nb))], bs)

    def attend(qx, kx, ks, vx, vs):
        return paged_attention_ref(qx, kx.view(nb, bs, hkv, d), vx.view(nb, bs, hkv, d), meta,
                                   0.02, None, ks, vs)

    exact = attend(q, k, None, v, None)
    errs = {}
    for name, rot in (("none", lambda x: x), ("hadamard", rotate)):
        ks, vs = kv_head_scales(rot(k), "fp8"), kv_head_scales(rot(v), "fp8")
        kq = quantize_kv_ref(rot(k), ks, torch.float8_e4m3fn)
        vq = quantize_kv_ref(rot(v), vs, torch.float8_e4m3fn)
        out = attend(rot(q), kq, ks, vq, vs)
        errs[name] = (rot(out) - exact).pow(2).mean().item()  # H @ H = I: back to V's coordinates
    assert errs["hadamard"] < 0.5 * errs["none"], errs


def test_build_picks_rotation_and_refits_scales(tiny_engine):
    qdir = tiny_engine("llama", kv_cache_dtype="fp8", calibration_samples=8)
    cfg, _, _ = load_engine(qdir, "cpu")
    assert cfg.kv_cache.rotation == "hadamard"  # auto: head_dim 16 is a power of two
    ndir = tiny_engine("llama", kv_cache_dtype="fp8", calibration_samples=8, kv_rotation="none")
    assert EngineConfig.load(ndir).kv_cache.rotation == "none"
    # same calibration, so the scales differ only because they are fitted to the rotated K and V
    from safetensors.torch import load_file
    rot, plain = (load_file(f"{d}/rank0.safetensors") for d in (qdir, ndir))
    torch.testing.assert_close(rot["layers.0.k_offset"], plain["layers.0.k_offset"])
    assert not torch.allclose(rot["layers.0.k_scale"], plain["layers.0.k_scale"])
    # float caches are never rotated; a head_dim that is no power of two gets none under auto
    assert qp.resolve_kv_rotation("auto", "auto", 64) == "none"
    assert qp.resolve_kv_rotation("auto", "int8", 18) == "none"


def test_bad_rotation_flags_fail_before_work(tiny_checkpoint, tmp_path):
    with pytest.raises(ValueError, match="--kv-rotation 'spin'.*allowed: auto, none, hadamard"):
        qp.validate_quant_args(kv_rotation="spin")
    with pytest.raises(ValueError, match="--kv-rotation hadamard needs a quantized cache"):
        qp.validate_quant_args(kv_rotation="hadamard")
    from tritium.builder.build import BuildOptions, build_engine
    out = tmp_path / "e"
    with pytest.raises(ValueError, match="--kv-rotation hadamard needs head_dim a power of two.*18"):
        build_engine(BuildOptions(source=tiny_checkpoint("mistral"), output=str(out), dtype="float32",
                                  kv_cache_dtype="int8", kv_rotation="hadamard", progress=False))
    assert not out.exists()


def test_engine_config_validates_rotation(tiny_engine):
    import dataclasses
    cfg = EngineConfig.load(tiny_engine("llama"))
    bad = dataclasses.replace(cfg, kv_cache=dataclasses.replace(cfg.kv_cache, rotation="spin"))
    with pytest.raises(EngineFormatError, match="kv_cache.rotation"):
        bad.validate()
    odd = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, head_dim=18),
                              kv_cache=dataclasses.replace(cfg.kv_cache, rotation="hadamard"))
    with pytest.raises(EngineFormatError, match="power of two"):
        odd.validate()
