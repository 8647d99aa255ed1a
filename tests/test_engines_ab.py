"""client/bench/engines_ab.py: its argument checks (the figures themselves are a benchmark's,
printed, never asserted)."""
from __future__ import annotations

import pytest

from tritium.client.bench import engines_ab


@pytest.mark.parametrize("flag", ["--threads", "--num-requests", "--concurrency", "--rounds"])
def test_counts_below_one_are_refused_naming_the_flag(flag, capsys):
    with pytest.raises(SystemExit) as e:
        engines_ab.main(["/nonexistent-a", "/nonexistent-b", flag, "0"])
    assert e.value.code == 2
    assert flag in capsys.readouterr().err


def test_one_engine_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        engines_ab.main(["/nonexistent-a"])
    assert e.value.code == 2
    assert "at least two" in capsys.readouterr().err
