"""Seeds of randomized tests, fixed per test id: every run draws the same inputs, so no test is
flaky, and a failure replays. TRITIUM_TEST_SEED=N shifts every seed to explore other inputs.
Successive calls within one test give distinct seeds (a loop over cases)."""
from __future__ import annotations

import os
import zlib
from collections import Counter

_calls: Counter = Counter()


def fixed_seed() -> int:
    test_id = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]
    n = _calls[test_id]
    _calls[test_id] += 1
    return (zlib.crc32(f"{test_id}#{n}".encode()) + int(os.environ.get("TRITIUM_TEST_SEED", "0"))) % (1 << 30)
