"""Shared helpers of the Triton launchers: input checks and interpreter quirks.

Import this (and every Triton kernel module) only after TRITON_INTERPRET has its final value:
`@triton.jit` decides at decoration time whether a kernel is compiled or interpreted.
"""
from __future__ import annotations

import os
from typing import Iterable, Optional

import torch
import triton
import triton.language as tl

TORCH_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def is_interpreter() -> bool:
    """True when Triton runs kernels in its numpy interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")


def dot_upcast(dtype: torch.dtype) -> bool:
    """Whether tl.dot operands of `dtype` must be upcast to fp32 before the dot.

    Triton 3.9's interpreter returns garbage for tl.dot on bf16 (and fp8) operands (numpy has no
    such types), so under the interpreter those operands are upcast; compiled GPU code keeps the
    native tensor-core dtype.
    """
    return is_interpreter() and dtype in (torch.bfloat16, torch.float8_e4m3fn)


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def check_dtype(name: str, t: torch.Tensor, allowed: Iterable[torch.dtype]) -> None:
    allowed = tuple(allowed)
    if t.dtype not in allowed:
        raise ValueError(f"{name}: dtype {t.dtype} not supported; allowed: "
                         f"{', '.join(str(a) for a in allowed)}")


def check_shape(name: str, t: torch.Tensor, shape: tuple) -> None:
    """shape entries may be None for 'any size'."""
    ok = t.dim() == len(shape) and all(s is None or s == d for s, d in zip(shape, t.shape))
    if not ok:
        want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
        raise ValueError(f"{name}: shape {tuple(t.shape)} does not match expected {want}")


def check_last_contiguous(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: last dimension must be contiguous (stride 1), got strides {t.stride()}")


def check_device(ref: torch.Tensor, **tensors: Optional[torch.Tensor]) -> None:
    for name, t in tensors.items():
        if t is not None and t.device != ref.device:
            raise ValueError(f"{name}: on {t.device}, expected {ref.device} like the other inputs")


@triton.jit
def mm(a, b, IEEE: tl.constexpr):
    """tl.dot with fp32 accumulation; IEEE keeps fp32 operands exact (no TF32) on tensor cores."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)
