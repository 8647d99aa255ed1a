"""Every Triton kernel variant compiles for an H100 (sm90) and fits its shared memory.

No GPU needed: Triton's bundled ptxas compiles ahead of time. Runs in a child process because
this session's kernel modules are decorated for the interpreter.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import triton

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


@pytest.mark.slow  # about 60 compiles (every GEMM config): 1-3 minutes on two busy cores
@pytest.mark.skipif(not os.path.exists(PTXAS) and shutil.which("ptxas") is None,
                    reason="Triton's NVIDIA backend (ptxas) is not installed")
def test_kernels_compile_for_sm90():
    script = os.path.join(os.path.dirname(__file__), "kernel_compile_sm90.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    assert r.stdout.count("ok ") >= 60, r.stdout  # every GEMM config of gemm_tuning.SPACES
