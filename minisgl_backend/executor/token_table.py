"""Per-request token rows: how a drawn token reaches the next iteration without the CPU planner, and
which rows are free (RowPool).

Row r holds request r's prompt and every token drawn for it, at their absolute positions. The
sampling stage writes token p at [r, p]; a later iteration gathers its inputs from [r, positions].
`ready[r]` counts the leading positions written: it is the sequence's step counter, and reading
position p before ready[r] > p would feed the model a token that was never drawn: the compute
stage asserts against it (step N+1 of a sequence must read what step N wrote).
"""

from __future__ import annotations

import numpy as np
import torch

from minisgl_backend.errors import InvariantError
from minisgl_backend.kvcache.reclaim import FencedReclaim


class TokenTable:
    """numpy-backed on the host: the copy stage writes it without starting a torch thread team."""

    def __init__(self, num_rows: int, width: int) -> None:
        self.ids = np.zeros((num_rows, width), dtype=np.int64)
        self.ready = np.zeros(num_rows, dtype=np.int64)

    def write_prompt(self, row: int, tokens: list[int]) -> None:
        self.ids[row, : len(tokens)] = tokens
        self.ready[row] = len(tokens)

    def write_drawn(self, rows: list[int], positions: list[int], tokens: list[int]) -> None:
        self.ids[rows, positions] = tokens
        for r, p in zip(rows, positions):
            self.ready[r] = max(self.ready[r], p + 1)

    def gather(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Input ids of one iteration; asserts every one was written before it is read."""
        r, p = rows.numpy(), positions.numpy()
        late = p >= self.ready[r]
        if late.any():
            i = int(np.argmax(late))
            raise InvariantError(
                f"read-after-write violated: row {r[i]} position {p[i]} read before its token was written "
                f"(ready={self.ready[r[i]]})"
            )
        return torch.from_numpy(self.ids[r, p])

    def history(self, row: int, start: int, end: int) -> list[int]:
        return self.ids[row, start:end].tolist()


class RowPool:
    """Which rows of the TokenTable are free: a row is handed to a request at admission and comes back
    behind a fence (kvcache/reclaim.py), like a KV block, since an in-flight iteration may still read it."""

    def __init__(self, num_rows: int, *, immediate: bool = False) -> None:
        self.num_rows = num_rows
        self._free: list[int] = list(range(num_rows))[::-1]  # LIFO: the newest freed row is reused first
        self._reclaim: FencedReclaim[int] = FencedReclaim(self._free.extend, immediate=immediate)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        return self._free.pop()

    def release(self, row: int, fence: int) -> None:
        self._reclaim.release([row], fence)

    def retire(self, completed: int) -> None:
        self._reclaim.retire(completed)

    def num_pending(self) -> int:
        return self._reclaim.num_pending
