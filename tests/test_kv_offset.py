"""The K/V offsets of a quantized KV cache (layers.{i}.k_offset / v_offset, subtracted before K
and V are stored, v_offset added back to the attention output): attention is unchanged in real
arithmetic (softmax ignores a per-query shift of all scores; the weights sum to 1), and with
FP8 storage the K offset removes the error a large constant part of K causes."""
import torch

from tritium.kernels.attention_metadata import AttentionMetadata
from tritium.backend.loader import load_engine
from simple_generate import alloc_kv_caches
from tritium.builder.quant.kv_scales import kv_head_offsets, kv_head_scales
from tritium.kernels.kv_write_ref import dequantize_kv_ref, quantize_kv_ref
from tritium.kernels.attention_ref import paged_attention_ref


@torch.inference_mode()
def chunked_then_decode_logits(model, ids, first_chunk):
    """Logits of every step: a prefill of ids[:first_chunk], then one token at a time (decode)."""
    bs = model.cfg.limits.block_size
    nb = -(-len(ids) // bs)
    kv = alloc_kv_caches(model, nb)
    table = [list(range(nb))]
    out = []
    done = 0
    for n in [first_chunk] + [1] * (len(ids) - first_chunk):
        meta = AttentionMetadata.build([n], [done + n], table, bs)
        hidden = model(torch.tensor(ids[done:done + n]), torch.arange(done, done + n), kv, meta)
        out.append(model.compute_logits(hidden[-1:]))
        done += n
    return torch.cat(out), kv


def test_kv_offsets_leave_float_attention_unchanged(tiny_engine):
    engine_dir = tiny_engine("qwen2")
    _, model, _ = load_engine(engine_dir, "cpu")
    ids = [3, 17, 42, 7, 99, 5, 12, 64, 33, 8, 21]
    ref, ref_kv = chunked_then_decode_logits(model, ids, 6)
    torch.manual_seed(0)
    m = model.cfg.model
    offsets = [(torch.randn(m.num_kv_heads, m.head_dim) * 3.0, torch.randn(m.num_kv_heads, m.head_dim))
               for _ in model.layers]
    for layer, (k_off, v_off) in zip(model.layers, offsets):
        layer.k_offset, layer.v_offset = k_off, v_off
    got, got_kv = chunked_then_decode_logits(model, ids, 6)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    # and they are really applied: every stored K and V (prefill and decode rows) moved
    n = len(ids)
    for ref_pair, got_pair, offs in zip(ref_kv, got_kv, offsets):
        for c_ref, c_got, off in zip(ref_pair, got_pair, offs):
            flat_ref = c_ref.reshape(-1, m.num_kv_heads, m.head_dim)[:n]
            flat_got = c_got.reshape(-1, m.num_kv_heads, m.head_dim)[:n]
            torch.testing.assert_close(flat_ref - flat_got, off.expand(n, -1, -1), rtol=1e-5, atol=1e-5)


def test_k_offset_removes_fp8_error_of_a_constant_k_part():
    torch.manual_seed(1)
    hq, hkv, d, bs, n = 4, 2, 32, 8, 40
    # K with a large constant part in a few channels (like low-frequency RoPE channels).
    const = torch.zeros(hkv, d)
    const[:, -4:] = torch.tensor([-13.0, 9.0, -11.0, 12.0])
    k = torch.randn(n, hkv, d) + const
    v = torch.randn(n, hkv, d)
    q = torch.randn(1, hq, d)
    nb = n // bs
    meta = AttentionMetadata.build([1], [n], [list(range(nb))], bs)

    def attend(k_stored, k_scale, v_stored, v_scale):
        return paged_attention_ref(q, k_stored.view(nb, bs, hkv, d), v_stored.view(nb, bs, hkv, d), meta,
                                   d ** -0.5, None, k_scale, v_scale)

    exact = attend(k, None, v, None)
    v_scale = kv_head_scales(v, "fp8")
    vq = quantize_kv_ref(v, v_scale, torch.float8_e4m3fn)
    errs = {}
    for name, off in (("none", torch.zeros(hkv, d)), ("offset", kv_head_offsets(k))):
        ks = kv_head_scales(k - off, "fp8")
        kq = quantize_kv_ref(k - off, ks, torch.float8_e4m3fn)
        # the offset version must also be exact when nothing is rounded
        torch.testing.assert_close(attend(k - off, None, v, None), exact, rtol=1e-4, atol=1e-5)
        errs[name] = (attend(kq, ks, vq, v_scale) - exact).abs().max().item()
        assert torch.isfinite(dequantize_kv_ref(kq, ks, torch.float32)).all()
    assert errs["offset"] < 0.5 * errs["none"], errs


def test_offsets_none_stores_zero_offsets_and_mean_does_not(tiny_engine):
    """kv_offsets='none' (the study option that measures what the offsets buy) writes zero
    offsets; the default 'mean' writes the calibration means (nonzero for a random model)."""
    import os

    from safetensors.torch import load_file

    from tritium.builder.quant.quant_pipeline import quantize_engine_weights
    fdir = tiny_engine("llama")
    cfg, _, tokenizer = load_engine(fdir, "cpu")
    tensors = load_file(os.path.join(fdir, "rank0.safetensors"))
    offs = {}
    for method in ("mean", "none"):
        new, _, kvcfg, report = quantize_engine_weights(cfg, tensors, kv_cache_dtype="int8", kv_offsets=method,
                                                        calibration_samples=4, eval_tokens=0, progress=False,
                                                        tokenizer=tokenizer)
        offs[method] = [t for k, t in sorted(new.items()) if k.endswith(("k_offset", "v_offset"))]
        assert len(offs[method]) == 2 * cfg.model.num_layers and report["kv_offsets"].startswith(
            "no offsets" if method == "none" else "per-KV-head means")
    assert all(bool((t == 0).all()) for t in offs["none"])
    assert all(float(t.abs().max()) > 0 for t in offs["mean"])
