"""Compiled (not interpreted) Triton kernels on a real GPU vs their torch references.

Needs CUDA, so it is marked `cuda` and reported as skipped on CPU machines. It runs in a child
process because this test session's kernel modules are decorated for the interpreter.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU: compiles the Triton kernels and checks them against "
                           "the torch references on the device (CPU runs use the interpreter tests)")
def test_compiled_kernels_match_references_on_cuda_kernel():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "tritium.client.cli", "bench-kernels", "--check-only", "--quick"],
                       env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "MISMATCH" not in r.stdout and "check:" in r.stdout, r.stdout
