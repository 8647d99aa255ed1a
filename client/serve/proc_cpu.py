"""Process groups seen through /proc (Linux): CPU seconds (how busy an 'idle' server is) and members."""
from __future__ import annotations

import os


def group_processes(pgids):
    """(pid, stat fields after the command name) of the live processes in the process groups `pgids`."""
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # fields[0] is the state (field 3 of stat): pgrp is field 5, utime 14, stime 15
        if int(fields[2]) in pgids:
            yield d, fields


def group_cpu_seconds(pgid: int) -> float:
    """user + system CPU seconds of the live processes whose process group is `pgid`."""
    ticks = sum(int(f[11]) + int(f[12]) for _, f in group_processes({pgid}))
    return ticks / os.sysconf("SC_CLK_TCK")
