"""client/bench/long_stream_bench.py runs and prints both pieces at every asked position; bad
flags are refused naming the flag."""
import pytest

from tritium.client.bench import long_stream_bench


def test_prints_both_pieces_at_every_position(capsys):
    assert long_stream_bench.main(["--tokens", "96", "--at", "16,64,96", "--rounds", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("response with log probs") and "cache_full_blocks" in lines[1]
    for line in lines:
        assert all(f"token {p}:" in line for p in (16, 64, 96)), line


@pytest.mark.parametrize("argv", [["--at", "8"], ["--at", "x"], ["--tokens", "100", "--at", "200"]])
def test_bad_flags_refused(argv, capsys):
    with pytest.raises(SystemExit):
        long_stream_bench.main(argv)
    assert "--at" in capsys.readouterr().err
