"""`tritium bench-kernels`: time the Triton kernels on realistic LLM shapes (needs a CUDA GPU).

Prints, per kernel and shape, the median time from triton.testing.do_bench, the achieved GB/s
and TFLOP/s, their share of the device's peaks, and the same shape through the torch baseline
timed in the same run (cuBLAS via F.linear on the dequantized bf16 weight, torch._scaled_mm for
FP8 W8A8, torch SDPA on unpaged K/V for attention) with the ratio baseline ms / Triton ms (> 1:
the Triton kernel is faster). `--check` first compares every kernel with its torch reference on
the GPU and exits 1 on a mismatch (used by the `cuda`-marked test). Without CUDA it prints that a
GPU is needed and exits 0 (it runs nothing: the CPU references are tested by the suite).
"""
from __future__ import annotations

import argparse
import os
from typing import Callable, List, Optional, Tuple

import torch

# (name substring, HBM GB/s, dense bf16 TFLOP/s, dense fp8 TFLOP/s) from the vendors' data sheets
PEAKS = [("H200", 4800, 989, 1979), ("H100 PCIe", 2000, 756, 1513), ("H100", 3350, 989, 1979),
         ("A100", 2039, 312, None), ("L40S", 864, 362, 733), ("L4", 300, 121, 242),
         ("A10", 600, 125, None)]

# Llama-3-8B-like dimensions (hidden 4096, 32 q heads, 8 kv heads, head_dim 128, MLP 14336)
HIDDEN, HQ, HKV, D, FFN = 4096, 32, 8, 128, 14336
# --check: max |kernel - reference| / max(1, max |reference|), every kernel (bf16 rounding)
CHECK_TOL = 0.03


def device_peaks(name: str) -> Tuple[Optional[float], Optional[float], Optional[float]]:
    for key, gbs, bf16, fp8 in PEAKS:
        if key in name:
            return gbs, bf16, fp8
    return None, None, None


def _pct(x: float, peak: Optional[float]) -> str:
    return f"{100 * x / peak:5.1f}%" if peak else "   n/a"


def _paged(b: int, ctx: int, block_size: int, dtype, device, kv_dtype=None):
    """Random paged cache + metadata for b sequences of ctx tokens each."""
    nblk = (ctx + block_size - 1) // block_size
    perm = torch.randperm(b * nblk).tolist()
    tables = [perm[i * nblk:(i + 1) * nblk] for i in range(b)]
    shape = (b * nblk, block_size, HKV, D)
    kc = torch.randn(shape, device=device, dtype=dtype)
    vc = torch.randn(shape, device=device, dtype=dtype)
    ks = vs = None
    if kv_dtype is not None:
        ks = torch.full((HKV,), 4.0 / 448, device=device)
        vs = ks.clone()
        kc, vc = (kc / 4.0 * 448).clamp(-448, 448).to(kv_dtype), (vc / 4.0 * 448).clamp(-448, 448).to(kv_dtype)
    return kc, vc, ks, vs, tables


def _sdpa(q, b, ctx, dtype, device, causal=False):
    """torch SDPA on contiguous K/V of the same shapes: q (B, Hq, Lq, D), K/V (B, Hkv, ctx, D)."""
    import torch.nn.functional as F
    k = torch.randn(b, HKV, ctx, D, device=device, dtype=dtype)
    v = torch.randn(b, HKV, ctx, D, device=device, dtype=dtype)
    return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


def _scaled_mm(x, w_fp8, w_scale):
    """torch._scaled_mm with row-wise scales, per-token activation quantization included."""
    def run():
        xs = x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / 448.0
        xq = (x / xs).clamp(-448, 448).to(torch.float8_e4m3fn)
        return torch._scaled_mm(xq, w_fp8.t(), scale_a=xs, scale_b=w_scale.view(1, -1), out_dtype=x.dtype)
    return run


def cases(dtype, device, quick: bool) -> List[Tuple[str, Callable, Callable, float, float, str, Optional[tuple]]]:
    """(label, kernel thunk, reference thunk, bytes moved, flops, flop kind, (baseline name, thunk)
    or None) per benchmark."""
    import torch.nn.functional as F
    from tritium.kernels.attention_metadata import AttentionMetadata
    from tritium.kernels import elementwise_triton as ew, gemm_ref, kv_write_triton as kvw, gemm_triton as qg
    from tritium.kernels import attention_decode_triton as pd, attention_prefill_triton as pa
    from tritium.kernels.kv_write_ref import kv_write_ref
    from tritium.kernels.attention_ref import paged_attention_ref
    from tritium.kernels.rms_norm_ref import rms_norm_ref
    from tritium.kernels.rotary_ref import rope_cos_sin_cache, rope_inv_freq, rotary_ref
    from tritium.kernels.silu_mul_ref import silu_mul_ref
    e = torch.empty((), dtype=dtype).element_size()
    t = 256 if quick else 4096
    out = []
    x, r = (torch.randn(t, HIDDEN, device=device, dtype=dtype) for _ in range(2))
    w = torch.randn(HIDDEN, device=device, dtype=dtype)
    out.append((f"rms_norm+res T={t} H={HIDDEN}", lambda: ew.rms_norm(x, w, 1e-6, r),
                lambda: rms_norm_ref(x, w, 1e-6, r), 4 * t * HIDDEN * e, 0, "", None))
    q, k = torch.randn(t, HQ, D, device=device, dtype=dtype), torch.randn(t, HKV, D, device=device, dtype=dtype)
    pos = torch.randint(0, 8192, (t,), device=device)
    cs = rope_cos_sin_cache(rope_inv_freq(D, 500000.0, "llama3", 8.0, 1.0, 4.0, 8192), 8192).to(device)
    out.append((f"rotary T={t} Hq={HQ} Hkv={HKV}", lambda: ew.rotary(q, k, pos, cs),
                lambda: rotary_ref(q, k, pos, cs), 2 * t * (HQ + HKV) * D * e, 0, "", None))
    gu = torch.randn(t, 2 * FFN, device=device, dtype=dtype)
    out.append((f"silu_mul T={t} N={FFN}", lambda: ew.silu_mul(gu), lambda: silu_mul_ref(gu),
                3 * t * FFN * e, 0, "", None))
    v = torch.randn(t, HKV, D, device=device, dtype=dtype)
    for kvd in (None, torch.float8_e4m3fn):
        kc, vc, ks, vs, _ = _paged(1, t, 16, dtype, device, kvd)
        kc2, vc2 = kc.clone(), vc.clone()
        slots = torch.randperm(kc.shape[0] * 16, device=device)[:t]
        ce = 1 if kvd is not None else e
        # the thunks return the caches so that --check compares what was written
        out.append((f"kv_write T={t} cache={kvd or dtype}",
                    lambda kc=kc, vc=vc, ks=ks, vs=vs, s=slots: kvw.kv_write(k, v, kc, vc, s, ks, vs) or (kc, vc),
                    lambda kc=kc2, vc=vc2, ks=ks, vs=vs, s=slots: kv_write_ref(k, v, kc, vc, s, ks, vs) or (kc, vc),
                    2 * t * HKV * D * (e + ce), 0, "", None))
    for b, ctx, kvd in ((64, 512 if quick else 2048, None), (8, 1024 if quick else 16384, None),
                        (64, 512 if quick else 2048, torch.float8_e4m3fn)):
        kc, vc, ks, vs, tables = _paged(b, ctx, 16, dtype, device, kvd)
        meta = AttentionMetadata.build([1] * b, [ctx] * b, tables, 16, device=device)
        qd = torch.randn(b, HQ, D, device=device, dtype=dtype)
        ce = 1 if kvd is not None else e
        out.append((f"paged_decode B={b} ctx={ctx} kv={kvd or dtype}",
                    lambda qd=qd, kc=kc, vc=vc, ks=ks, vs=vs, m=meta: pd.paged_decode(
                        qd, kc, vc, m.block_tables, m.seq_lens, D ** -0.5, None, ks, vs, max_seq_len=m.max_seq_len),
                    lambda qd=qd, kc=kc, vc=vc, ks=ks, vs=vs, m=meta: paged_attention_ref(
                        qd, kc, vc, m, D ** -0.5, None, ks, vs),
                    2 * b * ctx * HKV * D * ce, 4 * b * HQ * ctx * D, "bf16",
                    ("sdpa", _sdpa(qd.unsqueeze(2), b, ctx, dtype, device))))
    from tritium.kernels import mla_triton
    from tritium.kernels.mla_ref import mla_attention_ref
    for b, ctx in ((64, 512 if quick else 2048), (8, 1024 if quick else 16384)):
        # DeepSeek-V3's latent attention at TP 1: 128 heads, latent 512 + rope 64, one cache row a token
        nblk = -(-ctx // 16)
        lc = torch.randn(b * nblk, 16, 1, 576, device=device, dtype=dtype)
        tables = torch.randperm(b * nblk).view(b, nblk).tolist()
        meta = AttentionMetadata.build([1] * b, [ctx] * b, tables, 16, device=device)
        qm = torch.randn(b, 128, 576, device=device, dtype=dtype)
        out.append((f"mla decode B={b} ctx={ctx} H=128", lambda qm=qm, lc=lc, m=meta: mla_triton.mla_attention(
                        qm, lc, m, 192 ** -0.5, 512),
                    lambda qm=qm, lc=lc, m=meta: mla_attention_ref(qm, lc, m, 192 ** -0.5, 512),
                    b * ctx * 576 * e, 2 * b * 128 * ctx * (576 + 512), "bf16", None))
    b, L = (2, 256) if quick else (4, 2048)
    kc, vc, _, _, tables = _paged(b, L, 16, dtype, device)
    meta = AttentionMetadata.build([L] * b, [L] * b, tables, 16, device=device)
    qp = torch.randn(b * L, HQ, D, device=device, dtype=dtype)
    out.append((f"prefill B={b} L={L} causal", lambda: pa.paged_attention(qp, kc, vc, meta, D ** -0.5),
                lambda: paged_attention_ref(qp, kc, vc, meta, D ** -0.5),
                2 * b * L * (HQ + HKV) * D * e, 2 * b * HQ * L * L * D, "bf16",
                ("sdpa", _sdpa(qp.view(b, L, HQ, D).transpose(1, 2), b, L, dtype, device, causal=True))))
    g = 128
    for n, kk in ((HIDDEN, HIDDEN), (2 * FFN, HIDDEN)):
        # weights made once per shape; every batch size M below reuses them
        qw4 = torch.randint(0, 256, (n, kk // 2), device=device, dtype=torch.uint8)
        s4, z4 = torch.rand(kk // g, n, device=device) * 0.01, torch.randn(kk // g, n, device=device) * 0.01
        q8 = torch.randint(-127, 128, (n, kk), device=device, dtype=torch.int8)
        s8 = torch.rand(n, device=device) * 0.01
        f8 = (torch.randn(n, kk, device=device) * 64).to(torch.float8_e4m3fn)
        # cuBLAS baselines: the same weights dequantized once to the activation dtype
        w4 = gemm_ref.w4a16_gemm_ref(torch.eye(kk, device=device, dtype=torch.float32), qw4, s4, z4, g).t()
        w4, w8 = w4.to(dtype).contiguous(), (q8.float() * s8[:, None]).to(dtype)
        for m in ((16, 256) if quick else (1, 16, 256, 4096)):
            xg = torch.randn(m, kk, device=device, dtype=dtype)
            io = m * (n + kk) * e
            flops = 2 * m * n * kk
            out.append((f"w4a16 M={m} N={n} K={kk}", lambda xg=xg, a=qw4, s=s4, z=z4: qg.w4a16_gemm(xg, a, s, z, g),
                        lambda xg=xg, a=qw4, s=s4, z=z4: gemm_ref.w4a16_gemm_ref(xg, a, s, z, g),
                        n * kk // 2 + 8 * n * kk // g + io, flops, "bf16",
                        ("F.linear", lambda xg=xg, w=w4: F.linear(xg, w))))
            out.append((f"w8a16 M={m} N={n} K={kk}", lambda xg=xg, a=q8, s=s8: qg.w8a16_gemm(xg, a, s),
                        lambda xg=xg, a=q8, s=s8: gemm_ref.w8a16_gemm_ref(xg, a, s), n * kk + io, flops, "bf16",
                        ("F.linear", lambda xg=xg, w=w8: F.linear(xg, w))))
            out.append((f"fp8 W8A8 M={m} N={n} K={kk}", lambda xg=xg, a=f8, s=s8: qg.fp8_gemm(xg, a, s),
                        lambda xg=xg, a=f8, s=s8: gemm_ref.fp8_gemm_ref(xg, a, s), n * kk + io, flops, "fp8",
                        ("_scaled_mm", _scaled_mm(xg, f8, s8))))
    return out


def _flat(x):
    if isinstance(x, (tuple, list)):
        return torch.cat([t.float().flatten() for t in x])
    return x.float().flatten()


def run(args) -> int:
    if not torch.cuda.is_available():
        print("tritium bench-kernels: a CUDA GPU is needed to run the Triton kernels; none found. "
              "(On CPU the kernels are tested under TRITON_INTERPRET=1 instead.)")
        return 0
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("tritium bench-kernels: unset TRITON_INTERPRET to time compiled kernels")
        return 2
    import triton.testing
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    gbs_peak, bf16_peak, fp8_peak = device_peaks(name)
    print(f"device: {name}  peaks: {gbs_peak or '?'} GB/s, {bf16_peak or '?'} bf16 TFLOP/s, "
          f"{fp8_peak or '?'} fp8 TFLOP/s  dtype: {args.dtype}")
    torch.manual_seed(0)
    failures = 0
    print(f"{'kernel':48s} {'ms':>9s} {'GB/s':>8s} {'%bw':>6s} {'TFLOP/s':>8s} {'%peak':>6s} "
          f"{'baseline':>10s} {'base ms':>9s} {'base/ms':>8s}")
    for label, fn, ref, nbytes, flops, kind, base in cases(dtype, device, args.quick):
        if args.only and not any(s in label for s in args.only):
            continue
        if args.check:
            got, want = _flat(fn()), _flat(ref())
            err = (got - want).abs().max().item() / max(1.0, want.abs().max().item())
            # FP8 accumulates in full precision (max_num_imprecise_acc): the bf16 bound applies
            ok = err <= CHECK_TOL
            failures += not ok
            print(f"{label:48s} check: rel err {err:.2e} {'ok' if ok else 'MISMATCH'}")
            if args.check_only:
                continue
        rep = 50 if args.quick else 200
        ms = triton.testing.do_bench(fn, warmup=10, rep=rep)
        gbs = nbytes / ms / 1e6
        tfs = flops / ms / 1e9
        peak = fp8_peak if kind == "fp8" else bf16_peak
        base_cols = f"{'-':>10s} {'-':>9s} {'-':>8s}"
        if base is not None:
            try:
                base_ms = triton.testing.do_bench(base[1], warmup=10, rep=rep)
                base_cols = f"{base[0]:>10s} {base_ms:9.4f} {base_ms / ms:8.2f}"
            except Exception as exc:  # e.g. _scaled_mm's row-wise scales need sm89+
                base_cols = f"{base[0]:>10s} {'n/a':>9s} {'n/a':>8s}  ({type(exc).__name__})"
        print(f"{label:48s} {ms:9.4f} {gbs:8.1f} {_pct(gbs, gbs_peak)} {tfs:8.2f} "
              f"{_pct(tfs, peak) if flops else '   n/a'} {base_cols}")
    return 1 if failures else 0


def register(subparsers) -> None:
    p = subparsers.add_parser("bench-kernels", help="time the Triton kernels on a CUDA GPU",
                              description=__doc__.splitlines()[0])
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    p.add_argument("--quick", action="store_true", help="smaller shapes, fewer repetitions")
    p.add_argument("--check", action="store_true", help="compare each kernel with its reference first")
    p.add_argument("--check-only", action="store_true", help="only the comparison, no timing")
    p.add_argument("--only", nargs="*", help="run the kernels whose label contains one of these")
    p.set_defaults(func=lambda a: run(_normalise(a)))


def _normalise(args: argparse.Namespace) -> argparse.Namespace:
    if args.check_only:
        args.check = True
    return args
