"""How many threads a CPU forward runs on, and whose threads they are.

The count: the CPUs this process may use, i.e. its affinity mask (`taskset`, a container's cpuset)
capped by a cgroup CPU quota (`docker --cpus`), and at most torch's default (the physical cores), unless
`num_threads` says otherwise. A thread more than the CPUs it can run on only waits for them.

Whose threads: the native kernels run on their own pool (csrc/cpu/pool.h), which hands work out in
pieces a free thread claims and waits without spinning once the machine is busy, so a thread that the
OS deschedules costs the others little. Torch's intra-op threads are OpenMP's, which split each op
evenly and spin between ops; two teams spinning beside each other take each other's cores. So:

- where the kernels run the whole forward's heavy work (bfloat16 under a family whose kernels take
  every linear at every row count: amx, avx512bf16, avx2, and avx512 on a CPU without AVX512-BF16,
  cpu_kernels.kernel_row_limit), torch gets one thread (what is left to it is small: embedding rows,
  residual adds) and the kernels get the pool;
- where torch's ops do much of it (float32; the avx512 family's many-row linears where torch's bf16
  matmul has AVX512-BF16; the torch family),
  the kernels run on torch's OpenMP team, as torch's own ops do, and when that team is kept waiting
  for cores by another busy process (the pool sees the wait in the kernel's run-queue statistics,
  `OtherLoad` sees whose it is) the forward drops to one thread until it is not: an evenly split op
  on a busy machine is slower than one thread.

On the kernels' own pool a busy machine costs a step of a few decode rows more than its share too: such
a step reads every weight once for little arithmetic, one thread draws most of the memory's rate on
its own, and its ~150 short parallel regions each wake a second thread that the other process keeps
from its core. So those steps also run on one thread while other processes use the CPUs (`adapt`,
`OtherLoad`), and steps with more rows (prefill, wide decode batches), where the second thread's
arithmetic pays for its wake-ups, keep the planned count. The pool's own busy signal never decides
alone, on either team: it reads the kernels' threads kept waiting for a core, which the engine's own
scheduler and sampling threads also do on a small machine, and a step put on one thread by mistake
runs at half speed. A row's bits do not depend on the thread count on this pool.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from minisgl_backend.model import cpu_kernels

log = logging.getLogger("minisgl")

# Torch's intra-op default when this module is first imported (the physical cores, or what the user set).
_TORCH_DEFAULT = torch.get_num_threads()


def cgroup_cpu_quota(
    root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")
) -> float | None:
    """The CPUs' worth of time the process's cgroup may use (cgroup v2 `cpu.max`, or v1
    `cpu.cfs_quota_us` / `cpu.cfs_period_us`); None without a limit or where it cannot be read."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        rel = path.lstrip("/")
        if controllers == "":  # v2: walk up from the process's cgroup; the tightest limit wins
            best = None
            here = root / rel
            while True:
                try:
                    quota, period = (here / "cpu.max").read_text().split()[:2]
                    if quota != "max":
                        share = int(quota) / int(period)
                        best = share if best is None else min(best, share)
                except (OSError, ValueError):
                    pass
                if here == root or root not in here.parents:
                    break
                here = here.parent
            if best is not None:
                return best
        elif "cpu" in controllers.split(","):
            for base in (root / "cpu" / rel, root / "cpu,cpuacct" / rel, root / "cpu", root / "cpu,cpuacct"):
                try:
                    cfs_quota = int((base / "cpu.cfs_quota_us").read_text())
                    cfs_period = int((base / "cpu.cfs_period_us").read_text())
                except (OSError, ValueError):
                    continue
                return cfs_quota / cfs_period if cfs_quota > 0 and cfs_period > 0 else None
    return None


def usable_cpus() -> tuple[int, str]:
    """How many CPUs this process can compute on, and a phrase saying what limits it."""
    affinity = len(cpu_kernels.affinity())
    why = f"{_count(affinity, 'CPU')} in the affinity mask"
    count = affinity
    quota = cgroup_cpu_quota()
    if quota is not None and int(quota) < count:
        count = max(1, int(quota))
        why += f", a cgroup quota of {quota:g} CPUs"
    if _TORCH_DEFAULT < count:
        count = _TORCH_DEFAULT
        why += f", torch's default of {_TORCH_DEFAULT} threads (physical cores)"
    return count, why


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


@dataclass(frozen=True)
class ThreadPlan:
    threads: int  # the forward's threads (kernels, and torch where torch computes)
    torch_threads: int  # torch's intra-op threads
    openmp: bool  # kernels on torch's OpenMP team rather than their own pool
    why: str  # for the start-up line
    # On OpenMP, drop to one thread while the machine is busy (adapt). Off in the deterministic mode:
    # torch's float32 matmuls pick their kernels by thread count too, so the row tiles that mode
    # probed at start-up hold only at the count they were probed at.
    adaptive: bool = True

    def describe(self) -> str:
        if not self.openmp:
            pin = {"on": ", a CPU per thread", "off": ""}.get(
                os.environ.get("MINISGL_PIN_THREADS", "auto"), ", a CPU per thread while the machine is busy"
            )
            where = f"their own pool{pin}"
        elif self.adaptive:
            where = "torch's OpenMP team, one thread while the machine is busy"
        else:
            where = "torch's OpenMP team, at this count even on a busy machine (deterministic mode)"
        threads = _count(self.threads, "thread")
        return f"{threads} ({self.why}); kernels on {where}; torch intra-op {self.torch_threads}"


def plan(num_threads: int | None, dtype: str, deterministic: bool = False) -> ThreadPlan:
    """The threads a forward in `dtype` runs on under this process's kernel family (`deterministic`:
    at a fixed count, see ThreadPlan.adaptive)."""
    if num_threads:
        threads, why = num_threads, "num_threads"
    else:
        threads, why = usable_cpus()
    # the kernels run every bf16 linear at every row count: packed (amx, avx512bf16), or the few-row
    # kernel without a row limit (avx2; avx512 where torch's bf16 matmul lacks AVX512-BF16)
    own = (
        dtype == "bfloat16"
        and cpu_kernels.available()
        and (cpu_kernels.packs() or cpu_kernels.kernel_row_limit() is None)
    )
    return ThreadPlan(threads, 1 if own else threads, openmp=not own, why=why, adaptive=not deterministic)


# Decode rows up to which a step of the kernels' own pool runs on one thread while the machine is busy.
FEW_DECODE_ROWS = 8


class OtherLoad:
    """Whether other processes keep the CPUs busy: over windows of at least WINDOW_S, the CPU time
    the whole machine spent (/proc/stat: everything but idle and I/O wait; steal included, a
    hypervisor's other guests) less this process's own (/proc/self/stat), in CPUs' worth. Linux
    only; elsewhere never busy."""

    WINDOW_S = 0.1
    BUSY_CPUS = 0.5  # a competing process at one CPU's worth reads ~0.6-1.0 beside the forward

    def __init__(self, stat: Path = Path("/proc/stat"), self_stat: Path = Path("/proc/self/stat")) -> None:
        self._stat, self._self_stat = stat, self_stat
        self._last: tuple[float, float, float] | None = None  # (monotonic s, machine busy s, own s)
        self.busy = False
        self.others_cpus = 0.0

    def _read(self) -> tuple[float, float] | None:
        try:
            fields = self._stat.read_text().split("\n", 1)[0].split()[1:]
            own = self._self_stat.read_text()
        except OSError:
            return None
        ticks = [int(x) for x in fields]
        idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle, iowait
        # guest time is counted in user time already
        busy = sum(ticks[:8]) - idle if len(ticks) >= 8 else sum(ticks) - idle
        rest = own[own.rindex(")") + 2 :].split()
        return busy / _TICKS, (int(rest[11]) + int(rest[12])) / _TICKS

    def update(self, now: float) -> bool:
        """Re-read once a window has passed; the latest answer otherwise."""
        if self._last is not None and now - self._last[0] < self.WINDOW_S:
            return self.busy
        got = self._read()
        if got is None:
            return self.busy
        if self._last is not None:
            span = now - self._last[0]
            self.others_cpus = max(0.0, (got[0] - self._last[1]) - (got[1] - self._last[2])) / span
            self.busy = self.others_cpus >= self.BUSY_CPUS
        self._last = (now, *got)
        return self.busy


_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_OTHERS = OtherLoad()

_ACTIVE: ThreadPlan | None = None
# After the forward drops to one thread on a busy machine, how long it stays there before it tries its
# planned count again: at one thread the busy signal itself fades, and every try costs a few slow steps.
HOLD_S = 2.0
_held_until = 0.0


def apply(p: ThreadPlan) -> bool:
    """Make `p` the process's plan: torch's thread count, the kernels' count and pool. True if it
    differs from the plan before (what the engine's start-up line reports once)."""
    global _ACTIVE
    changed = p != _ACTIVE
    _ACTIVE = p
    torch.set_num_threads(p.torch_threads)
    cpu_kernels.set_threads(p.threads)
    cpu_kernels.use_openmp(p.openmp)
    return changed


def adapt(decode_rows: int | None = None) -> None:
    """Before a forward (on the thread that runs it): one thread while the kernels' threads are kept
    waiting for cores and other processes use the CPUs (OtherLoad), the planned count otherwise,
    under a plan whose threads are OpenMP's; under the kernels' own pool, one thread for a step of
    `decode_rows` decode rows and no prompt tokens (None: a step with prompt tokens) up to
    FEW_DECODE_ROWS while other processes use the CPUs, and the planned count for any other."""
    p = _ACTIVE
    if p is None or not p.adaptive or p.threads == 1:
        return
    global _held_until
    now = time.monotonic()
    others = _OTHERS.update(now)  # read every window, so the answer is about the latest one
    if p.openmp:
        # Both signals: the pool's alone reads the engine's own scheduler and sampling threads,
        # which keep the team waiting for a core on a small machine too, as a busy machine.
        if cpu_kernels.contended() and others:
            busy = True
            _held_until = now + HOLD_S
        else:
            busy = now < _held_until
        want = 1 if busy else p.threads
    else:
        few = decode_rows is not None and decode_rows <= FEW_DECODE_ROWS
        want = 1 if few and others else p.threads
    if cpu_kernels.threads() != want:
        if p.openmp:
            log.info(
                "machine %s: the forward now runs on %d thread(s)", "busy" if want == 1 else "free", want
            )
            torch.set_num_threads(want)
        cpu_kernels.set_threads(want)
