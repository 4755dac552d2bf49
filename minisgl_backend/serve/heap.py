"""The process's resident memory, and handing the C allocator's free memory back to the system.

glibc's malloc keeps what a large request freed (a long text tokenised, a large body parsed) in its
arenas for reuse, so the server's resident memory would stay at its highest point after the request
ended. `HeapTrimmer` gives it back with `malloc_trim(0)` once the resident memory has grown by a
threshold since the last time it did; the server asks it whenever its last request in flight ends
(serve/app.py), so its footprint returns close to its baseline after a burst. The trim walks the
allocator's free lists, which is cheap next to the work that filled them.
Off glibc (or off Linux) the functions answer None and the trimmer does nothing."""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable

# Resident growth since the last trim that is worth a trim: well above what one ordinary request
# allocates, well below what a tokenised text at the request-size limit leaves behind.
TRIM_GROWTH_BYTES = 32 * 1024 * 1024


def rss_bytes() -> int | None:
    """This process's resident memory in bytes, or None where /proc is missing."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _load_malloc_trim() -> Callable[[int], int] | None:
    try:
        fn = ctypes.CDLL(None).malloc_trim  # the libc the interpreter is linked with
    except (OSError, AttributeError):  # not glibc (musl, macOS, Windows): no such call
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


_MALLOC_TRIM = _load_malloc_trim()


def malloc_trim() -> bool:
    """Ask the C allocator to return its free memory to the system; False where there is no such call."""
    if _MALLOC_TRIM is None:
        return False
    _MALLOC_TRIM(0)
    return True


class HeapTrimmer:
    """Trims when the resident memory has grown by `threshold` bytes over the lowest point known (the
    value after the last trim, or at construction): the growth is what requests left in the
    allocator's free lists, or memory in use that a trim leaves in place (then the new value becomes
    the reference, so live memory does not cause a trim per call)."""

    def __init__(self, threshold: int = TRIM_GROWTH_BYTES) -> None:
        self.threshold = threshold
        self.trims = 0
        self._floor = rss_bytes()
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return _MALLOC_TRIM is not None and self._floor is not None

    def due(self) -> bool:
        """Whether the resident memory grew past the threshold (one read of /proc: cheap enough for
        the event loop)."""
        rss = rss_bytes() if self.enabled else None
        if rss is None or self._floor is None:
            return False
        if rss - self._floor < self.threshold:
            self._floor = min(self._floor, rss)  # memory given back by other means lowers the floor
            return False
        return True

    def maybe_trim(self) -> bool:
        """Trim if `due()`; True when it did. The trim walks the allocator's free lists (off the event
        loop: it takes longer, the more there is to give back)."""
        if not self._lock.acquire(blocking=False):  # a trim under way gives back what this one would
            return False
        try:
            if not self.due():
                return False
            malloc_trim()
            self.trims += 1
            self._floor = rss_bytes()
            return True
        finally:
            self._lock.release()
