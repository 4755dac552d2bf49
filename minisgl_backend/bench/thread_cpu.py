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


def _by_tid() -> dict[int, float]:
    out: dict[int, float] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        seconds = _stat_seconds(f"/proc/self/task/{tid}/stat")
        if seconds is not None:  # else the thread ended between listing and reading
            out[int(tid)] = seconds
    return out


def _waits_by_tid(tids: list[int]) -> dict[int, float]:
    """Seconds each thread spent runnable but off a CPU (the scheduler's run-queue wait, schedstat's
    second field): what other work on the machine cost it, apart from what it computed."""
    out: dict[int, float] = {}
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out[tid] = int(f.read().split()[1]) / 1e9
        except (OSError, IndexError, ValueError):  # ended, or a kernel without schedstats
            continue
    return out


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
        self.cpu = _by_tid()
        self.waits = _waits_by_tid(list(self.cpu))
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
