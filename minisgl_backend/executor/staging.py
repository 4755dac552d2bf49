"""Pinned host staging buffers for the CUDA back-end, and the lifetime rule that guards their reuse.

A host<->device copy with `non_blocking=True` reads (H2D) or writes (D2H) its pinned buffer some time
after the call returns, when the copy stream reaches it. Writing the next iteration's inputs into that
buffer before then corrupts a copy in flight. So every buffer belongs to a `StagingSlot`, and slots
come from a `StagingRing` that hands a slot out for iteration N and takes it back behind fence N
through the engine's one lifetime rule (FencedReclaim). The slot is reusable once iteration N has
completed. Completion comes after the copy worker was told (by the copy stream's host callback,
after the event of the slot's last copy, the logits D2H) that every copy of the slot is done and
after it sampled out of the logits buffer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from minisgl_backend.kvcache.reclaim import FencedReclaim


class StagingSlot:
    """One iteration's pinned host memory: a flat buffer per dtype for the inputs, one for the logits.

    Buffers grow on demand and are never shrunk. Growing replaces a buffer only while the slot is
    held, that is after its fence passed, so no copy can still be using the old one.
    """

    def __init__(self, pin: bool) -> None:
        self._pin = pin
        self._bufs: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def buffer(self, name: str, dtype: torch.dtype, numel: int) -> torch.Tensor:
        buf = self._bufs.get((name, dtype))
        if buf is None or buf.numel() < numel:
            size = max(numel, 2 * buf.numel() if buf is not None else 0)
            buf = self._bufs[(name, dtype)] = torch.empty(size, dtype=dtype, pin_memory=self._pin)
        return buf[:numel]

    def upload(
        self, tensors: Sequence[torch.Tensor | None], h2d: Callable[[torch.Tensor], torch.Tensor]
    ) -> list[torch.Tensor | None]:
        """Pack host tensors into this slot's pinned buffers (one per dtype) and copy each buffer to
        the device with one `h2d` (a non-blocking copy on the current stream: DeviceOps.h2d); returns
        device views in input order.
        Few large copies instead of many tiny ones: each copy pays a fixed launch cost that dwarfs
        moving a few hundred bytes."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            if t is not None:
                by_dtype.setdefault(t.dtype, []).append(t)
        on_device: dict[torch.dtype, torch.Tensor] = {}
        for dtype, group in by_dtype.items():
            host = self.buffer("in", dtype, sum(t.numel() for t in group))
            torch.cat([t.reshape(-1) for t in group], out=host)
            on_device[dtype] = h2d(host)
        offsets = dict.fromkeys(by_dtype, 0)
        out: list[torch.Tensor | None] = []
        for t in tensors:
            if t is None:
                out.append(None)
                continue
            start = offsets[t.dtype]
            offsets[t.dtype] = start + t.numel()
            out.append(on_device[t.dtype][start : start + t.numel()].view(t.shape))
        return out

    def download(
        self,
        logits: torch.Tensor,
        d2h: Callable[[torch.Tensor, torch.Tensor], None],
        name: str = "logits",
    ) -> torch.Tensor:
        """Start a copy of `logits` (float32 logits, or another output named `name`) into this slot
        with `d2h` (src, host: a non-blocking copy on the current stream: DeviceOps.d2h); the result
        may be read only after that stream passed the copy."""
        host = self.buffer(name, logits.dtype, logits.numel()).view(logits.shape)
        d2h(logits, host)
        return host


class StagingRing:
    """`size` staging slots. `acquire(N, completed)` returns a slot for iteration N, or None while
    every slot still waits for its fence: the caller waits until `oldest_fence()` has completed."""

    def __init__(self, size: int, pin: bool) -> None:
        if size < 1:
            raise ValueError("a staging ring needs at least one slot")
        self._free = [StagingSlot(pin) for _ in range(size)]
        self._reclaim: FencedReclaim[StagingSlot] = FencedReclaim(self._free.extend)

    def oldest_fence(self) -> int | None:
        """None when a slot is free now; else the iteration whose completion frees the next slot."""
        return None if self._free else self._reclaim.oldest_fence()

    def acquire(self, iteration: int, completed: int) -> StagingSlot | None:
        self._reclaim.retire(completed)
        if not self._free:
            return None
        slot = self._free.pop()
        self._reclaim.release([slot], fence=iteration)  # in use by `iteration` until it completes
        return slot

    @property
    def num_free(self) -> int:
        return len(self._free)
