"""Per-request token rows: how a drawn token reaches the next iteration without the CPU planner.

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
