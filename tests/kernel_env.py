"""Helpers of the Triton kernel tests; import before anything that imports the kernel modules.

Turns on Triton's interpreter (`TRITON_INTERPRET=1`, CPU tensors) before the Triton kernel
modules are imported: `@triton.jit` picks compiled-or-interpreted when a kernel is decorated.
"""
from __future__ import annotations

import importlib
import os
import random
import sys

os.environ["TRITON_INTERPRET"] = "1"

# Kernel modules someone imported earlier (compiled mode) are re-decorated, in dependency order.
for _name in ("triton_common", "kv_write_triton", "attention_decode_triton", "attention_prefill_triton",
              "elementwise_triton", "gemm_triton", "moe_triton", "lora_triton", "mla_triton"):
    _mod = sys.modules.get(f"tritium.kernels.{_name}")
    if _mod is not None:
        importlib.reload(_mod)

import torch  # noqa: E402

NUM_CASES = 20  # fresh random shapes per op, per run

# Per-dtype tolerance, relative to the largest |reference| value of the output:
#  fp32 1e-5: same maths, only summation order differs (fp32 eps 1.2e-7 times short sums);
#  fp16 3e-3: 11-bit mantissa (eps 9.8e-4); kernel and reference round intermediates differently;
#  bf16 2e-2: 8-bit mantissa (eps 7.8e-3); P is cast to bf16 before P@V in the kernel and the
#             reference rounds every op to bf16, so a couple of ulps apart is expected.
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
# FP8 E4M3 keeps 3 mantissa bits: one rounding decided differently (e.g. GPU division is not
# correctly rounded) moves a value by one step, 2^-3 relative at worst.
FP8_STEP = 0.125


def new_rng() -> tuple[random.Random, int]:
    """A fresh, unseeded draw per run; the seed is returned so failures can be reproduced.

    `TRITIUM_TEST_SEED=<seed>` replays a reported failure."""
    fixed = os.environ.get("TRITIUM_TEST_SEED")
    seed = int(fixed) if fixed else int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    return random.Random(seed), seed


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, msg: str = "") -> None:
    """|out - ref| <= tol * max(1, max|ref|) elementwise, tol from TOL; NaN anywhere fails."""
    tol = TOL[dtype]
    out, ref = out.float(), ref.float()
    assert not torch.isnan(out).any(), f"NaN in kernel output (unwritten elements?) {msg}"
    scale = max(1.0, ref.abs().max().item()) if ref.numel() else 1.0
    err = (out - ref).abs().max().item() if ref.numel() else 0.0
    assert err <= tol * scale, f"max |out - ref| = {err:.3g} > {tol} * {scale:.3g} ({dtype}) {msg}"


def nan_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))
