"""Which input widths torch's `aten._weight_int8pack_mm` (CPU) computes correctly.

Measured with torch 2.13 on this project's CPU (Zen 4, AVX-512), each width in its own
subprocess (`probe_width`, used by tests/test_quant_int8_grouped.py to check this rule):
- K a multiple of 16: correct for every N and row count tried;
- K a multiple of 8 but not of 16 (e.g. 72, 136): wrong results from 2 rows on, silently;
- any other K (e.g. 100, 20, 1): a segmentation fault.
Int8Linear therefore calls the kernel only where `int8pack_mm_safe(K)` holds, and otherwise
multiplies by the weight converted to bfloat16 (exact for int8 codes).
"""
from __future__ import annotations

import subprocess
import sys

SAFE_MULTIPLE = 16

_PROBE = """
import sys, torch
k, n = int(sys.argv[1]), int(sys.argv[2])
torch.manual_seed(0)
w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
s = torch.rand(n, dtype=torch.bfloat16) + 0.5
for m in (1, 2, 3, 8, 17):
    x = torch.randn(m, k, dtype=torch.bfloat16)
    y = torch.ops.aten._weight_int8pack_mm(x, w, s).float()
    ref = x.float() @ (w.float() * s.float()[:, None]).t()
    err = ((y - ref).abs() / (ref.abs() + 1.0)).max().item()
    if err > 0.05:
        print("wrong", m, err)
        sys.exit(3)
print("ok")
"""


def int8pack_mm_safe(in_features: int) -> bool:
    """Whether `_weight_int8pack_mm` may be called for weights of this input width."""
    return in_features % SAFE_MULTIPLE == 0


def probe_width(in_features: int, out_features: int = 64, timeout: float = 120.0) -> str:
    """Run the kernel at this width in a fresh Python and compare it with a float reference:
    'ok', 'wrong' (finished with wrong values) or 'crash' (the process died, e.g. SIGSEGV)."""
    r = subprocess.run([sys.executable, "-c", _PROBE, str(in_features), str(out_features)],
                       capture_output=True, text=True, timeout=timeout)
    if r.returncode == 0 and r.stdout.strip().endswith("ok"):
        return "ok"
    if r.returncode == 3:
        return "wrong"
    return "crash"
