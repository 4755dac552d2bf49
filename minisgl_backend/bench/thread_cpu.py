"""CPU seconds this process's threads used, by the role each plays in the engine or the server.

A throughput figure on a shared machine moves with whatever else runs there; the CPU time each
thread spent does not. So what a server's own threads cost beside the forward is told by CPU
seconds per output token of a served run against an offline run of the same requests, split by
role (`minisgl bench-serve --offline-baseline`).

Linux only (`/proc/self/task`); elsewhere `sample()` returns an empty dict and the split is left out.
"""

from __future__ import annotations

import os
import threading

# A thread's role from its name: the engine and the server name every thread they start.
ROLES: tuple[tuple[str, str], ...] = (
    ("minisgl-compute", "compute"),
    ("minisgl-copy", "copy (sampling)"),
    ("minisgl-scheduler", "scheduler"),
    ("minisgl-serve-cpu", "server workers"),
    ("AnyIO worker thread", "server workers"),
    ("minisgl-serve", "event loop"),
    ("minisgl-", "engine (other)"),
)
# Threads Python does not know: the native kernels' pool (and torch's, when it has threads).
NATIVE = "kernel pool"
# Any other Python thread: the offline run's client threads, the main thread waiting on them.
CLIENT = "clients"
# Roles that are not the engine's or the server's own work.
NOT_SERVER = frozenset({CLIENT})

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat_seconds(path: str) -> float | None:
    try:
        with open(path) as f:
            stat = f.read()
    except OSError:  # gone, or not Linux
        return None
    # The fields after the command name (which may hold spaces or parentheses): utime and stime
    # are the 12th and 13th of them.
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def process_seconds(pid: int) -> float:
    """CPU seconds process `pid` has used so far, every thread together (0.0 where unknown)."""
    return _stat_seconds(f"/proc/{pid}/stat") or 0.0


def _schedstat(tid: str) -> tuple[float, float] | None:
    """A thread's seconds on a CPU and seconds runnable but off one (the scheduler's run-queue wait:
    what other work on the machine cost it), both counted in nanoseconds; None where the thread has
    ended or the kernel keeps no schedstats."""
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            run, wait = f.read().split()[:2]
        return int(run) / 1e9, int(wait) / 1e9
    except (OSError, ValueError):
        return None


def _by_tid() -> tuple[dict[int, float], dict[int, float]]:
    """Every live thread's CPU seconds, and its run-queue wait where the kernel keeps schedstats.
    The CPU seconds come from schedstat too where it is there: `stat` counts in clock ticks (10 ms
    on most kernels), so a thread that ran a few ms between two samples could read zero."""
    cpu: dict[int, float] = {}
    waits: dict[int, float] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return cpu, waits
    for tid in tids:
        sched = _schedstat(tid)
        if sched is not None:
            cpu[int(tid)], waits[int(tid)] = sched
            continue
        seconds = _stat_seconds(f"/proc/self/task/{tid}/stat")
        if seconds is not None:  # else the thread ended between listing and reading
            cpu[int(tid)] = seconds
    return cpu, waits


def role(name: str | None) -> str:
    if name is None:
        return NATIVE
    for prefix, r in ROLES:
        if name.startswith(prefix):
            return r
    return CLIENT


class Sample:
    """Every live thread's CPU seconds (and run-queue wait) at one instant, with the thread's role."""

    def __init__(self) -> None:
        names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
        self.cpu, self.waits = _by_tid()
        self.roles = {tid: role(names.get(tid)) for tid in self.cpu}

    def _per_role(self, now: dict[int, float], then: dict[int, float]) -> dict[str, float]:
        out: dict[str, float] = {}
        for tid, v in now.items():
            r = self.roles[tid]
            out[r] = out.get(r, 0.0) + v - then.get(tid, 0.0)
        return {r: round(v, 3) for r, v in sorted(out.items(), key=lambda kv: -kv[1])}

    def since(self, earlier: Sample) -> dict[str, float]:
        """CPU seconds per role between `earlier` and this sample (a thread born in between counts
        from zero; one that ended in between is lost, so sample around work whose threads live on)."""
        return self._per_role(self.cpu, earlier.cpu)

    def waited_since(self, earlier: Sample) -> dict[str, float]:
        """Seconds per role that runnable threads waited for a CPU between the two samples (empty
        where the kernel keeps no schedstats)."""
        return self._per_role(self.waits, earlier.waits)


def server_seconds(split: dict[str, float]) -> float:
    """The CPU seconds of the engine's and the server's own threads in a split."""
    return sum(v for r, v in split.items() if r not in NOT_SERVER)
