"""Load-time warm-up of the quantized GEMMs: every row bucket of every linear shape.

On CUDA each (kernel, variant, row bucket, N, K) is timed over its config space and compiled
once here (kernels/gemm_tuning.py), so that serving neither compiles nor times a GEMM. Off
CUDA the Triton path runs only under the interpreter, where the same calls pick the fixed
per-bucket defaults.
"""
from __future__ import annotations

import torch

from ..kernels import ops
from ..kernels.gemm_tuning import LARGE, ROW_BUCKETS
from .quant import Fp8Linear, Int4Linear, Int6Linear, Int8Linear


def _run(mod, x: torch.Tensor) -> None:
    if isinstance(mod, Int4Linear):
        ops.linear_w4a16(x, mod.qweight, mod.scales, mod.zeros, mod.group_size, mod.g_idx)
    elif isinstance(mod, Int8Linear) or mod.group_size is not None:
        q = mod.int8_codes() if isinstance(mod, Int6Linear) else mod.qweight  # int6: codes as stored on CPU
        ops.linear_w8a16(x, q, mod.scales, zeros=mod.zeros, group_size=mod.group_size)
    else:
        ops.linear_fp8(x, mod.qweight, mod.scales)


def warm_up_gemms(model: torch.nn.Module, dtype: torch.dtype, max_rows: int) -> int:
    """Run each distinct quantized linear of `model` once per row bucket that a step of at most
    `max_rows` rows can reach. Returns the number of GEMMs run;
    0 when the Triton kernels do not serve this device."""
    seen, runs = set(), 0
    for mod in model.modules():
        if not isinstance(mod, (Int4Linear, Int8Linear, Fp8Linear)):
            continue
        sig = (type(mod), mod.in_features, mod.out_features, mod.group_size, getattr(mod, "g_idx", None) is not None,
               mod.qweight.dtype, getattr(mod, "zeros", None) is not None)
        if sig in seen:
            continue
        seen.add(sig)
        device = mod.qweight.device
        probe = torch.zeros((1, mod.in_features), dtype=dtype, device=device)
        if not ops.use_triton(probe):
            return 0
        lo = 1
        for bucket in ROW_BUCKETS:
            if lo > max_rows:
                break  # no step has that many rows
            # the largest bucket is timed at a prefill-sized M
            rows = bucket if bucket != LARGE else min(max_rows, 256)
            lo = bucket + 1
            _run(mod, torch.zeros((rows, mod.in_features), dtype=dtype, device=device))
            runs += 1
    return runs
