"""Fenced reclaim: the one rule behind every lifetime in the engine.

Anything an in-flight iteration may read — KV blocks, token-table rows, staging buffers — is
released with a *fence*: the id of the newest iteration submitted at release time. It becomes
reusable only when `retire(completed)` reports that iteration complete (iterations complete in
order). Holding an item one iteration longer costs a little memory; reusing it while an in-flight
iteration still reads it would mix one request's data into another's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

T = TypeVar("T")


class FencedReclaim(Generic[T]):
    def __init__(self, on_reusable: Callable[[list[T]], None], *, immediate: bool = False) -> None:
        self._on_reusable = on_reusable
        self._pending: deque[tuple[int, list[T]]] = deque()  # (fence, items), fences ascending
        self.num_pending = 0
        # Debug only (`debug_unsafe_reclaim`): ignore the fence, so an item can be reused while an
        # in-flight iteration still reads it (the cross-request leak the stress harness detects).
        self._immediate = immediate

    def release(self, items: Iterable[T], fence: int) -> None:
        items = list(items)
        if not items:
            return
        if self._immediate:
            self._on_reusable(items)
            return
        self.num_pending += len(items)
        if self._pending and self._pending[-1][0] == fence:
            self._pending[-1][1].extend(items)
        elif self._pending and self._pending[-1][0] > fence:
            raise AssertionError(f"fence {fence} is older than pending fence {self._pending[-1][0]}")
        else:
            self._pending.append((fence, items))

    def retire(self, completed: int) -> int:
        """Every iteration with id <= completed has finished: hand back what waited for them."""
        n = 0
        while self._pending and self._pending[0][0] <= completed:
            _, items = self._pending.popleft()
            self._on_reusable(items)
            n += len(items)
        self.num_pending -= n
        return n

    def oldest_fence(self) -> int | None:
        """The fence the next retire must pass to hand anything back (None: nothing pending)."""
        return self._pending[0][0] if self._pending else None

    def pending(self) -> list[T]:
        return [x for _, items in self._pending for x in items]

    def fences_ordered(self) -> bool:
        fences = [f for f, _ in self._pending]
        return fences == sorted(fences)
