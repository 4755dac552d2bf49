"""Paged KV block accounting with an explicit per-block state machine.

The KV pool is preallocated and split into fixed-size blocks, like pages in an OS; this module
records which request holds each block, its state and the free list.

    FREE --ALLOCATED--> WRITING --WRITE_COMPLETED--> READ_ONLY
      ^                    |                            |
      |                    +-----OWNER_RELEASED---------+--> PENDING_RECLAIM
      +------------------LAST_READER_DONE-------------------------+

Every transition goes through `_transition`, keyed by (state, event); anything else is a bug and
raises InvariantError. Only the scheduler thread calls into a BlockPool, so it takes no lock.

Reclaim never crosses a sync boundary: a released block carries a *fence*, the id of the newest
iteration submitted when it was released (the last one that may still read it). It becomes FREE
only when `retire(completed_iteration)` reports that iteration complete: holding a block one
iteration longer costs a little memory, while handing it to a new prefill that a running decode
still reads would put one request's K/V (and so its text) into another's reply.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterable

from minisgl_backend.errors import InvariantError
from minisgl_backend.kvcache.reclaim import FencedReclaim


class BlockState(enum.IntEnum):
    FREE = 0
    WRITING = 1
    READ_ONLY = 2
    PENDING_RECLAIM = 3


class BlockEvent(enum.Enum):
    ALLOCATED = "allocated for writing"
    WRITE_COMPLETED = "write completed"
    OWNER_RELEASED = "owner finished / aborted / preempted"
    LAST_READER_DONE = "last reader done"


_TRANSITIONS: dict[tuple[BlockState, BlockEvent], BlockState] = {
    (BlockState.FREE, BlockEvent.ALLOCATED): BlockState.WRITING,
    (BlockState.WRITING, BlockEvent.WRITE_COMPLETED): BlockState.READ_ONLY,
    (BlockState.WRITING, BlockEvent.OWNER_RELEASED): BlockState.PENDING_RECLAIM,
    (BlockState.READ_ONLY, BlockEvent.OWNER_RELEASED): BlockState.PENDING_RECLAIM,
    (BlockState.PENDING_RECLAIM, BlockEvent.LAST_READER_DONE): BlockState.FREE,
}


class BlockPool:
    """States, reference counts, free list and reclaim fences of `num_blocks` KV blocks."""

    def __init__(self, num_blocks: int, *, unsafe_immediate_reclaim: bool = False) -> None:
        self.num_blocks = num_blocks
        self.state = [BlockState.FREE] * num_blocks
        self.refcount = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        # Debug only (unsafe_immediate_reclaim): skip the fence, so a block can be reused while an
        # in-flight iteration still reads it (the cross-request leak the stress harness detects).
        self._reclaim: FencedReclaim[int] = FencedReclaim(self._free_now, immediate=unsafe_immediate_reclaim)

    # ---- the single place where states change ----
    def _transition(self, block: int, event: BlockEvent) -> None:
        try:
            self.state[block] = _TRANSITIONS[(self.state[block], event)]
        except KeyError:
            raise InvariantError(
                f"block {block}: illegal event {event.name} in state {self.state[block].name}"
            ) from None

    # ---- events ----
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_pending(self) -> int:
        """Blocks in PENDING_RECLAIM: free again once in-flight iterations complete."""
        return self._reclaim.num_pending

    def allocate(self, n: int) -> list[int]:
        """FREE -> WRITING for n blocks owned by one request; the caller checked `num_free`."""
        if n > len(self._free):
            raise InvariantError(f"allocate({n}) with only {len(self._free)} free blocks")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._transition(b, BlockEvent.ALLOCATED)
            self.refcount[b] = 1
        return blocks

    def write_completed(self, block: int) -> None:
        """WRITING -> READ_ONLY: every slot of the block holds K/V of a completed iteration."""
        self._transition(block, BlockEvent.WRITE_COMPLETED)

    def share(self, block: int) -> None:
        """Add a reader-owner to a READ_ONLY block (prefix sharing)."""
        if self.state[block] != BlockState.READ_ONLY:
            raise InvariantError(f"share() of block {block} in state {self.state[block].name}")
        self.refcount[block] += 1

    def release(self, blocks: Iterable[int], fence: int) -> None:
        """Drop one owner reference from each block. Blocks left without owners go to
        PENDING_RECLAIM until iteration `fence` (the newest one submitted) has completed."""
        orphaned = []
        for b in blocks:
            if self.refcount[b] <= 0:
                raise InvariantError(f"release of block {b} with refcount {self.refcount[b]}")
            self.refcount[b] -= 1
            if self.refcount[b] == 0:
                self._transition(b, BlockEvent.OWNER_RELEASED)
                orphaned.append(b)
        self._reclaim.release(orphaned, fence)

    def retire(self, completed_iteration: int) -> int:
        """Every iteration with id <= completed_iteration has finished: free what waited for them."""
        return self._reclaim.retire(completed_iteration)

    def _free_now(self, blocks: list[int]) -> None:
        for b in blocks:
            self._transition(b, BlockEvent.LAST_READER_DONE)
        self._free.extend(blocks)

    # ---- checks ----
    def counts(self) -> dict[str, int]:
        out = {s.name: 0 for s in BlockState}
        for s in self.state:
            out[s.name] += 1
        return out

    def check_invariants(self) -> dict[str, int]:
        """Verify the accounting; returns block counts per state. Raises InvariantError."""
        free = list(self._free)
        if len(set(free)) != len(free):
            raise InvariantError("free list holds a block twice")
        pending = self._reclaim.pending()
        if len(set(pending)) != len(pending) or set(pending) & set(free):
            raise InvariantError("a block is pending reclaim twice, or pending and free")
        if not self._reclaim.fences_ordered():
            raise InvariantError("reclaim fences out of order")
        free_set, pending_set = set(free), set(pending)
        for b in range(self.num_blocks):
            st, rc = self.state[b], self.refcount[b]
            if st == BlockState.FREE and (rc != 0 or b not in free_set):
                raise InvariantError(f"FREE block {b} has refcount {rc} or is missing from the free list")
            if st in (BlockState.WRITING, BlockState.READ_ONLY) and rc < 1:
                raise InvariantError(f"{st.name} block {b} has no owner")
            if st == BlockState.WRITING and rc != 1:
                raise InvariantError(f"WRITING block {b} has {rc} owners (only READ_ONLY may be shared)")
            if st == BlockState.PENDING_RECLAIM and (rc != 0 or b not in pending_set):
                raise InvariantError(f"PENDING_RECLAIM block {b} has refcount {rc} or no fence")
        counts = self.counts()
        if counts["FREE"] != len(free):
            raise InvariantError(f"{counts['FREE']} FREE blocks but free list holds {len(free)}")
        return counts
