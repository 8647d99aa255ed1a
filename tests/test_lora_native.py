"""The native CPU multi-LoRA kernel (kernels/cpu_lora.c via kernels/lora_cpu.py) against the
row-by-row torch reference (kernels/lora_ref.lora_delta_ref), on every native CPU path (the
cpu_path fixture forces avx512 / avx2 / generic): random mixes of adapters, per-slot ranks,
base-only rows, shapes with K and N tails, columns past one chunk; a row's result does not
depend on the other rows of the step (bit for bit); bad arguments are refused."""
from __future__ import annotations

import kernel_env  # noqa: F401
import pytest
import torch
from kernel_env import assert_close, new_rng

from tritium.kernels.lora_cpu import lora_add_native
from tritium.kernels.lora_ref import lora_delta_ref

DTYPES = (torch.float32, torch.bfloat16)


def _case(rng, dtype, n=None):
    t = rng.choice([1, 5, 16, 37])
    k, n = rng.choice([16, 72, 576]), n or rng.choice([8, 100, 960])
    slots, r = rng.choice([1, 3, 4]), rng.choice([1, 8, 48])
    ranks = [rng.choice([0, r, max(1, r // 2)]) for _ in range(slots)]
    ranks[rng.randrange(slots)] = r
    a = (torch.randn(slots, r, k) / k ** 0.5).to(dtype)
    bt = (torch.randn(slots, r, n) / r ** 0.5).to(dtype)
    for s, rs in enumerate(ranks):  # zero rows past each slot's rank, as the engine's stacks hold them
        a[s, rs:] = 0
        bt[s, rs:] = 0
    row_slots = torch.tensor([rng.choice([-1] + list(range(slots))) for _ in range(t)])
    return torch.randn(t, k).to(dtype), torch.randn(t, n).to(dtype), a, bt, row_slots, torch.tensor(ranks)


@pytest.mark.parametrize("case", range(8))
def test_native_lora_matches_reference(cpu_path, case):
    rng, seed = new_rng()
    dtype = DTYPES[case % 2]
    x, y, a, bt, rows, ranks = _case(rng, dtype, n=4100 if case == 7 else None)  # case 7: two column chunks
    want = y.float() + lora_delta_ref(x, a, bt, rows)
    got = lora_add_native(y.clone(), x, a, bt, rows, ranks)
    msg = f"path={cpu_path} seed={seed} rows={rows.tolist()} ranks={ranks.tolist()}"
    assert_close(got, want, dtype, msg)
    untouched = (rows < 0) | (ranks[rows.clamp(min=0)] == 0)
    assert torch.equal(got[untouched], y[untouched]), msg  # base rows and rank-0 slots: not written


def test_native_lora_rows_are_independent(cpu_path):
    """Each row alone (and in a batch of other rows, in another order) gives the same bits."""
    rng, seed = new_rng()
    x, y, a, bt, rows, ranks = _case(rng, torch.bfloat16)
    rows = torch.tensor([i % a.shape[0] for i in range(x.shape[0])])  # every row adapted
    batch = lora_add_native(y.clone(), x, a, bt, rows, ranks)
    perm = torch.randperm(x.shape[0])
    shuffled = lora_add_native(y[perm].clone(), x[perm].contiguous(), a, bt, rows[perm].contiguous(), ranks)
    assert torch.equal(shuffled, batch[perm]), f"path={cpu_path} seed={seed}"
    for i in range(x.shape[0]):
        alone = lora_add_native(y[i:i + 1].clone(), x[i:i + 1], a, bt, rows[i:i + 1], ranks)
        assert torch.equal(alone[0], batch[i]), f"row {i} path={cpu_path} seed={seed}"


def test_native_lora_refuses_bad_arguments(cpu_path):
    x, y = torch.randn(2, 16), torch.randn(2, 8)
    a, bt = torch.randn(2, 4, 16), torch.randn(2, 4, 8)
    with pytest.raises(ValueError, match="bad arguments"):
        lora_add_native(y, x, a, bt, torch.tensor([0, 2]), torch.tensor([4, 4]))  # slot 2 of 2
    with pytest.raises(ValueError, match="bad arguments"):
        lora_add_native(y, x, a, bt, torch.tensor([0, 1]), torch.tensor([4, 5]))  # rank 5 > R 4
    y0 = y.clone()
    with pytest.raises(ValueError):
        lora_add_native(y, x, a, bt, torch.tensor([0, 1]), torch.tensor([-1, 4]))
    assert torch.equal(y, y0)  # nothing written
