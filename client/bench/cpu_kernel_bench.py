"""The native CPU kernels on every instruction-set path this host runs, side by side with torch:
a benchmark that prints figures.

    python -m tritium.client.bench.cpu_kernel_bench [--threads 2] [--paths avx512 avx2 generic] [--rounds 5]

Shapes are SmolLM2-135M's (hidden 576, MLP 1536, 9 query / 3 KV heads of 64). Each round times
every kernel on every path in turn (interleaved, so load from other processes hits them alike;
the paths are loaded side by side in this process with TRITIUM_CPU_ISA, kernels/cpu_isa.py);
prints the median microseconds per call, and for each GEMM torch's float32 matmul on the same
shape (`f32 torch`, the speed a float32 engine gets) and the ratio of each path to it.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Dict, List, Optional

import torch

from tritium.kernels import cpu_isa, cpu_linear, cpu_native

HIDDEN, FFN, HQ, HKV, D = 576, 1536, 9, 3, 64


def _time(fn: Callable[[], object], min_s: float = 0.05) -> float:
    fn()
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        dt = time.perf_counter() - t0
        if dt >= min_s:
            return dt / n * 1e6


def _gemm_cases(m: int) -> Dict[str, Callable]:
    """name -> (native call, float32 torch call) at SmolLM2's MLP shapes for m rows."""
    cases = {}
    for n, k in ((FFN, HIDDEN), (HIDDEN, FFN)):
        x = torch.randn(m, k).bfloat16()
        xf = x.float()
        wb = (torch.randn(n, k) / k ** 0.5).bfloat16()
        wf = wb.float()
        q8 = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        s8 = torch.rand(n) / 50
        g = 32
        sg, zg = torch.rand(k // g, n) / 50, torch.randn(k // g, n) / 50
        params = cpu_native.pack_group_params(sg, zg)
        q4 = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
        tag = f"M={m} N={n} K={k}"
        f32 = (lambda xf=xf, wf=wf: torch.nn.functional.linear(xf, wf))
        bf = (lambda x=x, wb=wb: torch.nn.functional.linear(x, wb))
        cases[f"bf16 gemm {tag}"] = (lambda x=x, wb=wb: cpu_native.bf16_gemm(x, wb), f32, bf, _onednn(x, wb))
        cases[f"int8 w8a16 {tag}"] = (lambda x=x, q=q8, s=s8: cpu_native.w8a16_gemm(x, q, s), f32, None, None)
        cases[f"int8 grouped {tag}"] = (lambda x=x, q=q8, p=params: cpu_native.w8g_gemm(x, q, p, g), f32, None, None)
        cases[f"int4 {tag}"] = (lambda x=x, q=q4, s=sg.half(), z=zg.half(): cpu_native.w4_gemm(x, q, s, z, g),
                                f32, None, None)  # float16 parameters, as engines store them
    # bf16 only: fused gate_up, o_proj / q_proj, k_proj / v_proj
    for n, k in ((2 * FFN, HIDDEN), (HIDDEN, HIDDEN), (HKV * D, HIDDEN)):
        x = torch.randn(m, k).bfloat16()
        wb = (torch.randn(n, k) / k ** 0.5).bfloat16()
        f32 = (lambda xf=x.float(), wf=wb.float(): torch.nn.functional.linear(xf, wf))
        bf = (lambda x=x, wb=wb: torch.nn.functional.linear(x, wb))
        cases[f"bf16 gemm M={m} N={n} K={k}"] = (lambda x=x, wb=wb: cpu_native.bf16_gemm(x, wb), f32, bf,
                                                 _onednn(x, wb))
    return cases


def _onednn(x: torch.Tensor, w: torch.Tensor) -> Optional[Callable]:
    """oneDNN's bf16 GEMM on a weight pre-packed as kernels/cpu_linear.py packs it (None where
    this torch has no oneDNN bf16)."""
    if not cpu_linear._onednn_packing():
        return None
    pw = torch.ops.mkldnn._reorder_linear_weight(w, None)
    return lambda: torch.ops.mkldnn._linear_pointwise(x, pw, None, "none", [], "")


def _other_cases(rows: int, ctx: int) -> Dict[str, Callable]:
    from tritium.kernels.rotary_ref import rope_cos_sin_cache, rope_inv_freq, rotary_tables
    bs = 16
    nblk = (ctx + bs - 1) // bs
    kc = torch.randn(rows * nblk, bs, HKV, D).bfloat16()
    vc = torch.randn_like(kc)
    q = torch.randn(rows, HQ, D).bfloat16()
    out = torch.empty_like(q)
    tables = torch.arange(rows * nblk, dtype=torch.int32).view(rows, nblk)
    r = torch.tensor([[i, i, 0, ctx] for i in range(rows)], dtype=torch.int64)
    x, res = torch.randn(rows, HIDDEN).bfloat16(), torch.randn(rows, HIDDEN).bfloat16()
    w = torch.randn(HIDDEN).bfloat16()
    gu = torch.randn(rows, 2 * FFN).bfloat16()
    qkv = torch.randn(rows, (HQ + 2 * HKV) * D).bfloat16()
    tabs = rotary_tables(torch.arange(rows), rope_cos_sin_cache(rope_inv_freq(D, 10000.0), max(64, rows)), torch.bfloat16)
    slots = torch.arange(rows)
    return {
        f"decode attention rows={rows} ctx={ctx}":
            lambda: cpu_native.paged_decode_bf16(q, kc, vc, tables, r, D ** -0.5, out),
        f"add+rmsnorm T={rows}": lambda: cpu_native.add_rms_norm_bf16(x, w, 1e-5, res),
        f"silu*mul T={rows}": lambda: cpu_native.silu_mul_bf16(gu),
        f"rope+kv write T={rows}": lambda: cpu_native.rotary_kv_write_bf16(qkv, HQ, HKV, D, tabs, kc, vc, slots),
    }


def _use(path: str) -> None:
    cpu_native.use_path(path)
    assert cpu_native.isa() == path


def run(paths: List[str], rounds: int, rows: List[int]) -> Dict[str, Dict[str, float]]:
    """{kernel: {path or 'f32 torch' / 'bf16 torch': median us}}."""
    cases = {}
    for m in rows:
        cases.update(_gemm_cases(m))
    for m in rows:
        cases.update({k: (v, None, None, None) for k, v in _other_cases(m, 256).items()})
    samples: Dict[str, Dict[str, List[float]]] = {k: {} for k in cases}
    for _ in range(rounds):
        for path in paths:
            _use(path)
            for name, (fn, _, _, _) in cases.items():
                samples[name].setdefault(path, []).append(_time(fn))
        for name, (_, f32, bf, dnn) in cases.items():
            if dnn is not None:
                samples[name].setdefault("bf16 oneDNN", []).append(_time(dnn))
            if f32 is not None:
                samples[name].setdefault("f32 torch", []).append(_time(f32))
            if bf is not None:
                samples[name].setdefault("bf16 torch", []).append(_time(bf))
    return {k: {p: statistics.median(v) for p, v in d.items()} for k, d in samples.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=None, help="torch / OpenMP threads (default: torch's)")
    p.add_argument("--paths", nargs="+", choices=cpu_isa.PATHS, default=None,
                   help="native paths to time (default: every path this host runs)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16], help="rows per call (default 1 16)")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    paths = args.paths or cpu_isa.runnable()
    bad = [x for x in paths if x not in cpu_isa.runnable()]
    if bad:
        p.error(f"--paths: this CPU cannot run {', '.join(bad)}; allowed here: {', '.join(cpu_isa.runnable())}")
    with cpu_native.paths_restored():
        res = run(paths, args.rounds, args.rows)
    cols = paths + ["f32 torch", "bf16 torch", "bf16 oneDNN"]
    print(f"threads={torch.get_num_threads()}  median us per call  (x: f32 torch time / path time; "
          f"in the oneDNN column: {paths[0]} time / oneDNN time)")
    print(f"{'kernel':44s}" + "".join(f"{c:>18s}" for c in cols))
    for name, d in res.items():
        line = f"{name:44s}"
        for c in cols:
            if c not in d:
                line += f"{'':>18s}"
                continue
            ratio = f" ({d['f32 torch'] / d[c]:.2f}x)" if "f32 torch" in d and c in paths else ""
            if c == "bf16 oneDNN" and paths[0] in d:
                ratio = f" ({d[paths[0]] / d[c]:.2f})"
            line += f"{d[c]:>10.1f}{ratio:>8s}"
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
