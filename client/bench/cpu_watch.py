"""What runs on the host's cores around a bandwidth probe (bandwidth_probe.py): the CPU time of
every thread of the watched process groups (the servers) and of the benchmark process itself,
from /proc/<pid>/task/<tid>/schedstat (its first field: nanoseconds on a CPU, exact, where
/proc/.../stat counts 10 ms ticks, too coarse for a 10-25 ms probe), and a bounded wait until
they have gone quiet.

A sample is {group: {tid: (thread name, run ns[, ns waited runnable for a CPU])}}; `busy_cores`
turns two samples into cores per group (CPU seconds / wall seconds), `queued_cores` the same for
the time the threads were ready but waited for a CPU (schedstat's second field: someone else had
the cores), `busiest` names the threads behind them.
"""
from __future__ import annotations

import os
import time
from typing import Callable, Dict, Iterable, List, Optional, Tuple

Sample = Dict[str, Dict[int, Tuple[str, int]]]
CLIENT = "client"  # the benchmark process's group name (less the probe's own threads)
PROBE = "probe"    # the probe's own threads (CpuWatch `exclude`), shown apart, never waited for


def task_run_ns(pid: int) -> Dict[int, Tuple[str, int, int]]:
    """{tid: (thread name, ns run on a CPU, ns waited runnable for a CPU)} of every live thread of
    `pid` ({} when it is gone)."""
    out: Dict[int, Tuple[str, int, int]] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for t in tids:
        try:
            with open(f"/proc/{pid}/task/{t}/schedstat") as f:
                run, queued = (int(x) for x in f.read().split()[:2])
            with open(f"/proc/{pid}/task/{t}/comm") as f:
                comm = f.read().strip()
        except (OSError, ValueError):
            continue
        out[int(t)] = (comm, run, queued)
    return out


def group_pids(pgid: int) -> List[int]:
    """The live processes of process group `pgid`."""
    from tritium.client.serve.proc_cpu import group_processes
    return [int(pid) for pid, _ in group_processes({pgid})]


class CpuWatch:
    """Samples the threads of the process groups `pgids` ({name: pgid}, e.g. a server started with
    start_new_session) and, with `client`, of this process less the thread ids in `exclude` (the
    probe's own). Group members are looked up again by `refresh()` (a /proc scan, a few ms), not
    at every sample. `read_tasks` / `list_group` are replaceable (tests)."""

    def __init__(self, pgids: Dict[str, int], client: bool = True, exclude: Iterable[int] = (),
                 read_tasks: Callable[[int], Dict[int, Tuple[str, int]]] = task_run_ns,
                 list_group: Callable[[int], List[int]] = group_pids, self_pid: Optional[int] = None):
        if CLIENT in pgids or PROBE in pgids:
            raise ValueError(f"a watched process group cannot be named {CLIENT!r} or {PROBE!r} (this process)")
        self.pgids = dict(pgids)
        self.client = client
        self.exclude = set(exclude)
        self._read, self._list = read_tasks, list_group
        self._self_pid = os.getpid() if self_pid is None else self_pid
        self._pids: Dict[str, List[int]] = {}
        self.refresh()

    def refresh(self) -> None:
        self._pids = {name: self._list(g) for name, g in self.pgids.items()}
        if self.client:
            self._pids[CLIENT] = [self._self_pid]

    def groups(self) -> List[str]:
        return list(self._pids) + ([PROBE] if self.client else [])

    def sample(self, skip: Iterable[int] = ()) -> Sample:
        """Every watched thread's run ns; the client's less `exclude` and `skip` (e.g. the thread
        that samples, whose CPU between two samples is mostly the sampling)."""
        out: Sample = {}
        drop = self.exclude | set(skip)
        for name, pids in self._pids.items():
            tasks: Dict[int, Tuple[str, int]] = {}
            for pid in pids:
                tasks.update(self._read(pid))
            if name == CLIENT:
                out[PROBE] = {t: v for t, v in tasks.items() if t in self.exclude}
                tasks = {t: v for t, v in tasks.items() if t not in drop}
            out[name] = tasks
        return out


def host_ticks(path: str = "/proc/stat") -> Tuple[int, int, int]:
    """The whole host's (busy, steal, all) clock ticks since boot from /proc/stat's "cpu" line:
    busy = user + nice + system + irq + softirq; steal = time the hypervisor gave this VM's CPUs
    to someone else. Ticks are 1 / SC_CLK_TCK s (10 ms): over one 10-25 ms probe a rough figure,
    over many a fair one."""
    with open(path) as f:
        v = [int(x) for x in f.readline().split()[1:]]
    v += [0] * (8 - len(v))
    user, nice, system, idle, iowait, irq, softirq, steal = v[:8]
    busy = user + nice + system + irq + softirq
    return busy, steal, busy + steal + idle + iowait


def host_cores(a: Tuple[int, int, int], b: Tuple[int, int, int], seconds: float) -> Dict[str, float]:
    """{"busy", "steal"}: the host's cores busy (every process, this one included) and stolen
    between two host_ticks readings `seconds` apart."""
    hz = os.sysconf("SC_CLK_TCK")
    return {"busy": (b[0] - a[0]) / hz / seconds, "steal": (b[1] - a[1]) / hz / seconds}


def busy_cores(a: Sample, b: Sample, seconds: float) -> Dict[str, float]:
    """Cores each group kept busy between samples a and b, `seconds` apart (threads born in
    between count from 0; threads gone by b are not counted)."""
    if seconds <= 0:
        raise ValueError(f"busy_cores: seconds must be > 0, got {seconds}")
    out = {}
    for name, tasks in b.items():
        before = a.get(name, {})
        ns = sum(max(0, v[1] - before.get(t, (None, 0))[1]) for t, v in tasks.items())
        out[name] = ns / 1e9 / seconds
    return out


def queued_cores(a: Sample, b: Sample, seconds: float) -> Dict[str, float]:
    """Per group, the threads' seconds ready to run but waiting for a CPU between a and b, over
    `seconds` (a thread sample without that field counts 0)."""
    if seconds <= 0:
        raise ValueError(f"queued_cores: seconds must be > 0, got {seconds}")
    out = {}
    for name, tasks in b.items():
        before = a.get(name, {})
        ns = 0
        for t, v in tasks.items():
            if len(v) > 2:
                old = before.get(t)
                ns += max(0, v[2] - (old[2] if old is not None and len(old) > 2 else 0))
        out[name] = ns / 1e9 / seconds
    return out


def busiest(a: Sample, b: Sample, n: int = 3, min_ns: int = 100_000) -> List[Tuple[str, str, int, float]]:
    """The n threads with the most CPU between a and b (at least min_ns): (group, thread name,
    tid, milliseconds), most first."""
    rows = []
    for name, tasks in b.items():
        before = a.get(name, {})
        for t, (comm, ns, *_) in tasks.items():
            d = ns - before.get(t, (None, 0))[1]
            if d >= min_ns:
                rows.append((name, comm, t, d / 1e6))
    rows.sort(key=lambda r: -r[3])
    return rows[:n]


def wait_quiet(watch: CpuWatch, quiet_cores: float, max_wait_s: float, poll_s: float = 0.02,
               clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep,
               skip: Iterable[int] = ()) -> dict:
    """Poll every `poll_s` until the watched groups (not the probe's own threads) kept at most
    `quiet_cores` cores busy together over the last poll, or `max_wait_s` has passed (then it gives
    up: quiet False). Returns
    {"wait_s", "quiet", "polls", "cores": {group: cores over the last poll}}. max_wait_s 0: one
    poll. `skip`: thread ids left out of the client group (CpuWatch.sample)."""
    if quiet_cores < 0 or max_wait_s < 0 or poll_s <= 0:
        raise ValueError(f"wait_quiet: quiet_cores and max_wait_s must be >= 0 and poll_s > 0, got "
                         f"{quiet_cores}, {max_wait_s}, {poll_s}")
    watch.refresh()
    t0 = clock()
    prev, tp = watch.sample(skip), t0
    polls = 0
    while True:
        sleep(poll_s)
        cur, tc = watch.sample(skip), clock()
        polls += 1
        cores = busy_cores(prev, cur, max(tc - tp, 1e-9))
        waited = tc - t0
        busy = sum(c for g, c in cores.items() if g != PROBE)
        if busy <= quiet_cores or waited >= max_wait_s:
            return {"wait_s": waited, "quiet": busy <= quiet_cores, "polls": polls, "cores": cores}
        prev, tp = cur, tc
