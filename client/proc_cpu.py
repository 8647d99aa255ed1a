"""CPU seconds used by a process group, from /proc (Linux): how busy an 'idle' server is."""
from __future__ import annotations

import os


def group_cpu_seconds(pgid: int) -> float:
    """user + system CPU seconds of the live processes whose process group is `pgid`."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # fields[0] is the state (field 3 of stat): pgrp is field 5, utime 14, stime 15
        if int(fields[2]) == pgid:
            total += int(fields[11]) + int(fields[12])
    return total / tick
