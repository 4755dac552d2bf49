"""The progress watchdog: a loop that keeps running iterations but moves no request forward is a
livelock, and must surface as an error, never as a silent spin at 100% CPU.

Progress is the Scheduler's `progress` counter (committed tokens, finished requests, positions
computed for the first time). A stall is `timeout_s` of wall time AND at least `min_iterations`
completed iterations without progress: a single slow forward (a big model, a long chunk) is not a
stall, and iterations that legitimately produce nothing (late results past EOS, work dropped by one
preemption) are bounded by the pipeline depth, far below `min_iterations`.
"""

from __future__ import annotations

import time

from minisgl_backend.errors import EngineStalledError


class ProgressWatchdog:
    def __init__(self, timeout_s: float, min_iterations: int) -> None:
        self.timeout_s = timeout_s  # 0 turns the watchdog off
        self.min_iterations = min_iterations
        self._progress = -1
        self._since = time.monotonic()
        self._idle_iterations = 0

    def observe(self, progress: int, completed_iterations: int, busy: bool) -> None:
        """Scheduler thread, once per loop turn. Raises EngineStalledError on a stall."""
        now = time.monotonic()
        if progress != self._progress or not busy:
            self._progress, self._since, self._idle_iterations = progress, now, 0
            return
        self._idle_iterations += completed_iterations
        if (
            self.timeout_s
            and now - self._since >= self.timeout_s
            and self._idle_iterations >= self.min_iterations
        ):
            raise EngineStalledError(
                f"no progress for {now - self._since:.1f}s over {self._idle_iterations} iterations "
                "(iterations run but no token is committed and no request finishes: a scheduling "
                "livelock; stall_timeout_s sets the limit)"
            )
