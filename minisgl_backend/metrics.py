"""Bookkeeping kept off the hot path: metrics in per-thread buffers, logs in a ring buffer.

Neither touches a lock on the hot path. A counter is added to the calling thread's own dict (only
that thread writes it); an aggregator thread folds all buffers into totals about once per second and
logs the periodic stats line. `exact=True` (config `metrics_exact`) is the profiling path: every add
goes straight into shared totals under a lock, so a snapshot is exact at any moment.
Log records go to a bounded deque (the oldest is dropped when full) that a background thread flushes;
`MINISGL_DEBUG_LOG=1` turns on per-iteration debug records.
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import sys
import threading
import time
from collections.abc import Callable

log = logging.getLogger("minisgl")
DEBUG_LOG = os.environ.get("MINISGL_DEBUG_LOG") == "1"


class Metrics:
    def __init__(
        self,
        *,
        exact: bool = False,
        interval_s: float = 1.0,
        stats_line: Callable[[dict[str, float], dict[str, float], float], str | None] | None = None,
        stats_every_s: float = 0.0,
    ) -> None:
        self.exact = exact
        self._local = threading.local()
        self._buffers: list[dict[str, float]] = []  # one per recording thread, written only by it
        self._register_lock = threading.Lock()
        self._exact_lock = threading.Lock()
        self._totals: dict[str, float] = {}
        self._stats_line = stats_line
        self._stats_every = stats_every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._aggregate_loop, args=(interval_s,), name="minisgl-metrics", daemon=True
        )
        self._thread.start()

    def add(self, name: str, value: float = 1.0) -> None:
        if self.exact:
            with self._exact_lock:
                self._totals[name] = self._totals.get(name, 0.0) + value
            return
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = {}
            with self._register_lock:  # once per thread, not per add
                self._buffers.append(buf)
        buf[name] = buf.get(name, 0.0) + value

    def set(self, name: str, value: float) -> None:
        """A gauge (last value wins); written by one thread only (the scheduler)."""
        if self.exact:
            with self._exact_lock:
                self._totals[name] = value
        else:
            self._totals[name] = value

    def snapshot(self) -> dict[str, float]:
        """Totals as of the last aggregation (exact mode: as of now)."""
        with self._exact_lock:
            return dict(self._totals)

    def _fold(self) -> None:
        if self.exact:
            return
        with self._register_lock:
            buffers = list(self._buffers)
        sums: dict[str, float] = {}
        for buf in buffers:  # counters are cumulative per thread: reading them loses nothing
            for k, v in list(buf.items()):
                sums[k] = sums.get(k, 0.0) + v
        with self._exact_lock:
            self._totals.update(sums)

    def _aggregate_loop(self, interval_s: float) -> None:
        last_line = time.monotonic()
        prev = self.snapshot()
        while not self._stop.wait(interval_s):
            self._fold()
            now = time.monotonic()
            if self._stats_line and self._stats_every > 0 and now - last_line >= self._stats_every:
                cur = self.snapshot()
                line = self._stats_line(cur, prev, now - last_line)
                if line:  # None: nothing happened since the last one
                    log.info(line)
                prev, last_line = cur, now

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._fold()


class Tracer:
    """Chrome-trace spans per lane (scheduler / compute / copy) when `trace` is on: whether
    planning, compute and copies really overlap is read off a timeline, not assumed. Appending to a
    list is atomic under the GIL."""

    LANES = ("scheduler", "compute", "copy")

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.spans: list[tuple[str, str, float, float]] = []  # (lane, name, start, end) perf_counter s

    def span(self, lane: str, name: str, start: float, end: float) -> None:
        if self.enabled:
            self.spans.append((lane, name, start, end))

    def chrome_events(
        self, pid: int = 0, process_name: str = "minisgl", t0: float | None = None
    ) -> list[dict]:
        t0 = min((s[2] for s in self.spans), default=0.0) if t0 is None else t0
        events: list[dict] = [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": process_name}}]
        events += [
            {"name": "thread_name", "ph": "M", "pid": pid, "tid": i, "args": {"name": lane}}
            for i, lane in enumerate(self.LANES)
        ]
        events += [
            {
                "name": name,
                "ph": "X",
                "pid": pid,
                "tid": self.LANES.index(lane),
                "ts": (a - t0) * 1e6,
                "dur": (b - a) * 1e6,
            }
            for lane, name, a, b in self.spans
        ]
        return events

    def busy_overlap(self) -> float:
        """Fraction of the scheduler lane's busy time during which the compute lane was busy too."""

        def busy(lane: str) -> list[tuple[float, float]]:
            return sorted((a, b) for ln, _, a, b in self.spans if ln == lane)

        compute, total, both = busy("compute"), 0.0, 0.0
        for a, b in busy("scheduler"):
            total += b - a
            both += sum(max(0.0, min(b, d) - max(a, c)) for c, d in compute if c < b and d > a)
        return both / total if total else 0.0


class RingBufferHandler(logging.Handler):
    """Keeps the newest `capacity` records; a background thread hands them to `target`, so
    logging never blocks the scheduler thread on I/O."""

    def __init__(
        self, target: logging.Handler, capacity: int = 10_000, flush_interval_s: float = 0.2
    ) -> None:
        super().__init__()
        self.target = target
        self.records: collections.deque[logging.LogRecord] = collections.deque(maxlen=capacity)
        self._wake = threading.Event()
        self._interval = flush_interval_s
        threading.Thread(target=self._flush_loop, name="minisgl-log-flush", daemon=True).start()

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)  # deque.append with maxlen drops the oldest; atomic under the GIL

    def flush(self) -> None:
        try:
            while self.records:
                self.target.handle(self.records.popleft())
            self.target.flush()
        except IndexError:
            pass  # emptied concurrently
        except (ValueError, OSError):
            self.records.clear()  # the stream is gone (interpreter exit): nothing left to write to

    def _flush_loop(self) -> None:
        while True:
            self._wake.wait(self._interval)
            self.flush()


_installed: RingBufferHandler | None = None


def flush_logging() -> None:
    """Write out every log record still in the ring buffer (before a last line printed to stderr)."""
    if _installed is not None:
        _installed.flush()


def install_logging() -> None:
    """Route the `minisgl` logger through the ring buffer to stderr, unless the application already
    configured a handler for it."""
    global _installed
    if _installed is not None or log.handlers:
        return
    target = logging.StreamHandler(sys.stderr)
    target.setFormatter(logging.Formatter("%(asctime)s minisgl %(levelname)s %(message)s"))
    _installed = RingBufferHandler(target)
    atexit.register(_installed.flush)  # the flusher is a daemon thread: hand over what is left
    log.addHandler(_installed)
    log.setLevel(logging.DEBUG if DEBUG_LOG else logging.INFO)
    log.propagate = False
