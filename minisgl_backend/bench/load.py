"""A competing load for the benchmarks: N processes that each keep one CPU busy, as a browser, a
compile or another job would on a user's machine, so a workload can be measured idle and busy in one
run. Each process is a bare loop that ends by itself after its time limit, and all of them end when
the block exits, however it exits."""

from __future__ import annotations

import subprocess
import sys
from types import TracebackType

# One CPU's worth of work that stops by itself: argv[1] is the limit in seconds.
_LOOP = (
    "import sys, time\nend = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < end:\n    pass\n"
)


class CompetingLoad:
    """`with CompetingLoad(n):` runs the block beside n busy processes (none for n = 0), each ended
    after `limit_s` seconds at the latest."""

    def __init__(self, n: int, limit_s: float = 1800.0) -> None:
        if n < 0:
            raise ValueError(f"a competing load is 0 or more busy processes, got {n}")
        self.n, self.limit_s = n, limit_s
        self._procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> CompetingLoad:
        for _ in range(self.n):
            self._procs.append(subprocess.Popen([sys.executable, "-c", _LOOP, str(self.limit_s)]))
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for p in self._procs:
            p.kill()
        for p in self._procs:
            p.wait()
        self._procs.clear()

    @property
    def running(self) -> int:
        """How many of the busy processes are still running."""
        return sum(p.poll() is None for p in self._procs)
