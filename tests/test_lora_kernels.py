"""Multi-LoRA segmented kernels: the Triton kernel (interpreter) and the grouped CPU path against
the row-by-row torch reference, on random mixes of adapters, ranks and base-only rows."""
from __future__ import annotations

import kernel_env  # noqa: F401  (must precede the kernel imports: sets TRITON_INTERPRET=1)
import pytest
import torch
from kernel_env import assert_close, new_rng

from tritium.kernels.lora_ref import LoRASegments, lora_add_grouped, lora_delta_ref
from tritium.kernels.lora_triton import lora_add_sgmv

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _case(rng, dtype):
    t = rng.choice([1, 3, 17, 40])
    k, n = rng.choice([24, 72, 100]), rng.choice([18, 96, 130])
    slots, r = rng.choice([1, 3, 4]), rng.choice([4, 8, 24])
    a = (torch.randn(slots, r, k) / k ** 0.5).to(dtype)
    b = (torch.randn(slots, r, n) / r ** 0.5).to(dtype)  # B transposed
    row_slots = [rng.choice([None] + list(range(slots))) for _ in range(t)]
    x = torch.randn(t, k).to(dtype)
    y = torch.randn(t, n).to(dtype)
    return x, y, a, b, row_slots


def _expected(x, y, a, b, row_slots):
    rs = torch.tensor([-1 if s is None else s for s in row_slots])
    return y.float() + lora_delta_ref(x, a, b, rs)


@pytest.mark.parametrize("case", range(9))
def test_sgmv_kernel_matches_reference(case):
    rng, seed = new_rng()
    dtype = DTYPES[case % 3]
    x, y, a, b, row_slots = _case(rng, dtype)
    seg = LoRASegments.from_row_slots(row_slots, x.device)
    got = lora_add_sgmv(y.clone(), x, a, b, seg)
    assert_close(got, _expected(x, y, a, b, row_slots), dtype, f"seed={seed} slots={row_slots}")


@pytest.mark.parametrize("case", range(6))
def test_grouped_cpu_path_matches_reference(case):
    rng, seed = new_rng()
    dtype = DTYPES[case % 3]
    x, y, a, b, row_slots = _case(rng, dtype)
    if case == 0:
        row_slots = [1 % a.shape[0]] * len(row_slots)  # one adapter on every row: the no-gather path
    seg = LoRASegments.from_row_slots(row_slots, x.device)
    got = lora_add_grouped(y.clone(), x, a, b, seg)
    assert_close(got, _expected(x, y, a, b, row_slots), dtype, f"seed={seed} slots={row_slots}")


def test_grouped_subset_of_slots_and_untouched_base_rows():
    """A step using some of the slots (gathered stacks), uneven segments (padding), base rows."""
    x, y = torch.randn(6, 16), torch.randn(6, 8)
    a, bt = torch.randn(4, 6, 16), torch.randn(4, 6, 8)
    row_slots = [3, 1, None, 1, 3, 1]
    seg = LoRASegments.from_row_slots(row_slots, "cpu")
    assert seg.seg_slots == [1, 3] and seg.max_len == 3 and seg.pad_mask is not None
    got = lora_add_grouped(y.clone(), x, a, bt, seg)
    torch.testing.assert_close(got, _expected(x, y, a, bt, row_slots))
    assert torch.equal(got[2], y[2])  # a base-only row is untouched


def test_sgmv_rejects_bad_shapes():
    seg = LoRASegments.from_row_slots([0, 0], "cpu")
    with pytest.raises(ValueError, match="bt_stack"):
        lora_add_sgmv(torch.zeros(2, 8), torch.zeros(2, 4), torch.zeros(1, 3, 4), torch.zeros(1, 9, 3), seg)
