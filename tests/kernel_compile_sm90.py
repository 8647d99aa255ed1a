"""Compile every Triton kernel variant for an H100 (sm90) with Triton's bundled ptxas; no GPU needed.

Run as a script with TRITON_INTERPRET unset (test_kernels_compile.py does). Catches what the
interpreter cannot: type errors of the compiled language, unsupported dot operand types, layouts,
and kernels whose shared memory exceeds an H100's 227 KiB per block. Prints one line per variant.
"""
from __future__ import annotations

import os
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from tritium.kernels import elementwise_triton as ew  # noqa: E402
from tritium.kernels import gemm_tuning  # noqa: E402
from tritium.kernels import kv_write_triton as kvw  # noqa: E402
from tritium.kernels import mla_triton as mla  # noqa: E402
from tritium.kernels import attention_decode_triton as pd  # noqa: E402
from tritium.kernels import attention_prefill_triton as pa  # noqa: E402
from tritium.kernels import gemm_triton as qg  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
H100_SMEM = 227 * 1024
FLOAT_ARGS = {"eps", "scale_log2", "min_amax", "softcap_log2"}


def compile_variant(fn, ptrs: dict, consts: dict, num_warps: int = 4, num_stages: int = 3):
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = ptrs[name]
        elif name in FLOAT_ARGS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    src = ASTSource(fn, signature=sig, constexprs=consts)
    return triton.compile(src, target=TARGET, options={"num_warps": num_warps, "num_stages": num_stages})


def variants():
    bf, f32 = "*bf16", "*fp32"
    yield "rms_norm+res", ew._rms_norm_kernel, dict.fromkeys(
        ["x_ptr", "res_ptr", "w_ptr", "out_ptr", "res_out_ptr"], bf), dict(HAS_RESIDUAL=True, BLOCK_N=4096), 16
    yield "rotary", ew._rotary_kernel, {"x_ptr": bf, "out_ptr": bf, "pos_ptr": "*i64", "cs_ptr": f32}, \
        dict(BLOCK_H=16, BLOCK_HALF=64), 4
    yield "silu_mul", ew._silu_mul_kernel, {"x_ptr": bf, "out_ptr": bf}, dict(BLOCK_N=1024), 4
    for kind, cache in ((0, bf), (1, "*i8"), (2, "*fp8e4nv")):
        yield f"kv_write kind={kind}", kvw._kv_write_kernel, {
            "k_ptr": bf, "v_ptr": bf, "k_cache_ptr": cache, "v_cache_ptr": cache, "slot_ptr": "*i64",
            "k_scale_ptr": f32, "v_scale_ptr": f32}, dict(KIND=kind, BLOCK_H=8, BLOCK_D=128), 4
    for dt, cache, quant in ((bf, bf, False), (bf, "*fp8e4nv", True), (bf, "*i8", True), (f32, f32, False)):
        for split in ((False, True) if dt == bf else (False,)):
            yield f"paged_decode q={dt} cache={cache} split={split}", pd._paged_decode_kernel, {
                "q_ptr": dt, "k_cache_ptr": cache, "v_cache_ptr": cache, "bt_ptr": "*i32", "seq_lens_ptr": "*i32",
                "k_scale_ptr": f32, "v_scale_ptr": f32, "out_ptr": dt, "part_acc_ptr": f32, "part_ml_ptr": f32,
            }, dict(PARTITION=pd.DECODE_PARTITION, BLOCK_N=64, BLOCK_G=16, BLOCK_D=128, KV_QUANT=quant, USE_SPLIT=split,
                    UPCAST=False, IEEE=dt == f32), 4
        yield f"prefill q={dt} cache={cache}", pa._prefill_attention_kernel, {
            "q_ptr": dt, "k_cache_ptr": cache, "v_cache_ptr": cache, "bt_ptr": "*i32", "seq_lens_ptr": "*i32",
            "qsl_ptr": "*i32", "seq_ids_ptr": "*i32", "k_scale_ptr": f32, "v_scale_ptr": f32, "sinks_ptr": f32,
            "out_ptr": dt,
        }, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_D=128, KV_QUANT=quant, UPCAST=False, IEEE=dt == f32,
                HAS_SINKS=cache == bf), 8
    for dt in (bf, f32):  # DeepSeek-V3's latent 512 + rope 64
        yield f"mla q={dt}", mla._mla_kernel, {
            "q_ptr": dt, "cache_ptr": dt, "bt_ptr": "*i32", "row_seq_ptr": "*i32", "row_ctx_ptr": "*i32",
            "out_ptr": dt}, dict(RANK=512, ROPE=64, BLOCK_R=512, BLOCK_P=64, BLOCK_H=16, BLOCK_N=16, PAGE=16,
                                 IEEE=dt == f32), 4
    for sinks in (False, True):
        yield f"paged_decode_reduce sinks={sinks}", pd._paged_decode_reduce_kernel, {
            "part_acc_ptr": f32, "part_ml_ptr": f32, "sinks_ptr": f32, "out_ptr": bf}, dict(
                BLOCK_S=pd.REDUCE_CHUNK, BLOCK_D=128, HAS_SINKS=sinks), 4
    yield "split_k_reduce", qg._split_k_reduce_kernel, {"part_ptr": f32, "bias_ptr": bf, "out_ptr": bf}, dict(
        HAS_BIAS=True, BLOCK=1024), 4
    yield from gemm_variants()


def _tiles(kernel: str):
    """Every distinct compiled form of a kernel's config space: (tile consts, split, warps, stages)."""
    seen = []
    for c in gemm_tuning.SPACES[kernel]:
        key = (dict(BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k), c.split_k > 1, c.num_warps,
               c.num_stages)
        if key not in seen:
            seen.append(key)
    return seen


def gemm_variants():
    """The quantized GEMMs: every config of the autotune space for the common variant of each
    kernel (bf16 activations), one config for the other variants."""
    bf, f32 = "*bf16", "*fp32"
    w4 = {"x_ptr": bf, "qw_ptr": "*u8", "scales_ptr": f32, "zeros_ptr": f32, "gidx_ptr": "*i32",
          "bias_ptr": bf, "out_ptr": bf, "part_ptr": f32}
    for i, (tile, split, warps, stages) in enumerate(_tiles("w4a16")):
        # the asymmetric layout (zeros) in each group case; the symmetric one (no zeros) too, first tile
        cases = ((False, True, True), (True, False, True), (False, False, True), (False, True, False),
                 (True, False, False), (False, False, False))
        for gidx, aligned, zeros in cases if i == 0 else cases[:1]:
            yield f"w4a16 g_idx={gidx} aligned={aligned} zeros={zeros} {tile} split={split} warps={warps}", \
                qg._w4a16_gemm_kernel, w4, dict(HAS_GIDX=gidx, GROUP_ALIGNED=aligned, HAS_BIAS=True, SPLIT=split,
                                                UPCAST=False, IEEE=False, HAS_ZEROS=zeros, **tile), warps, stages
    for i, (tile, split, warps, stages) in enumerate(_tiles("w8a16")):
        for w in ("*i8", "*fp8e4nv"):
            for grouped, zeros, aligned in ((False, False, False), (True, True, True), (True, True, False)):
                if i and (w != "*i8" or grouped):
                    continue
                yield f"w8a16 w={w} grouped={grouped} aligned={aligned} {tile} split={split} warps={warps}", \
                    qg._w8a16_gemm_kernel, {"x_ptr": bf, "qw_ptr": w, "scales_ptr": f32, "zeros_ptr": f32,
                                            "bias_ptr": bf, "out_ptr": bf, "part_ptr": f32}, dict(
                        GROUPED=grouped, HAS_ZEROS=zeros, GROUP_ALIGNED=aligned, HAS_BIAS=False, SPLIT=split,
                        UPCAST=False, IEEE=False, **tile), warps, stages
    yield "fp8_quant_per_token", qg._fp8_quant_per_token_kernel, {
        "x_ptr": bf, "xq_ptr": "*fp8e4nv", "scale_ptr": f32}, dict(BLOCK_K=1024), 4
    for tile, split, warps, stages in _tiles("fp8"):
        yield f"fp8_gemm {tile} split={split} warps={warps}", qg._fp8_gemm_kernel, {
            "xq_ptr": "*fp8e4nv", "x_scale_ptr": f32, "qw_ptr": "*fp8e4nv", "w_scale_ptr": f32, "bias_ptr": bf,
            "out_ptr": bf, "part_ptr": f32}, dict(HAS_BIAS=True, SPLIT=split, OPERANDS=0, **tile), warps, stages


def _compile_one(index: int):
    label, fn, ptrs, consts, warps, *stages = list(variants())[index]
    t0 = time.time()
    try:
        smem = compile_variant(fn, ptrs, consts, warps, *stages).metadata.shared
        return label, smem, None, time.time() - t0
    except Exception as e:  # report every variant, then fail
        return label, None, f"{type(e).__name__}: {str(e)[:2000]}", time.time() - t0


def main() -> int:
    from concurrent.futures import ProcessPoolExecutor
    failures = 0
    # variants compile independently: one process per core
    with ProcessPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
        for label, smem, err, secs in pool.map(_compile_one, range(len(list(variants())))):
            if err is not None:
                failures += 1
                print(f"ERR {label}: {err}", flush=True)
                continue
            ok = smem <= H100_SMEM
            failures += not ok
            print(f"{'ok ' if ok else 'BIG'} {label}: shared {smem} B, {secs:.1f}s", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
