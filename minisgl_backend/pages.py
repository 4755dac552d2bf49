"""Large CPU tensors in anonymous memory mappings of their own, asked to be backed by 2 MB pages.

Two properties make such a mapping the right home for the engine's big, long-lived CPU buffers
(packed weights, the KV pool):

- A weight stream (a decode step reads every packed weight once) or a walk over scattered KV
  blocks pays a TLB walk per page: on the 4 KB pages an unadvised allocation gets where
  transparent huge pages are `madvise` (the common default), that is 512 times as many as on
  2 MB pages.
- The kernel hands a fresh mapping's pages out zero-filled on first touch, so a zeroed buffer costs
  nothing at allocation: torch.zeros would touch (fault in and write) every page of a
  gigabyte-sized pool at start-up, where here only the pages the engine ever writes are faulted
  in, when it first writes them.
"""

from __future__ import annotations

import math
import mmap

import torch

from minisgl_backend.arith import cdiv

HUGE_PAGE = 2 << 20


def _mapped(numel: int, dtype: torch.dtype) -> torch.Tensor | None:
    """A 1-D tensor over a fresh anonymous mapping advised MADV_HUGEPAGE (the tensor keeps the
    mapping alive), or None where the platform has no MADV_HUGEPAGE or for less than one huge page."""
    nbytes = numel * dtype.itemsize
    if not hasattr(mmap, "MADV_HUGEPAGE") or nbytes < HUGE_PAGE:
        return None
    region = mmap.mmap(-1, cdiv(nbytes, HUGE_PAGE) * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(region, dtype=dtype, count=numel)


def huge_page_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D CPU tensor of `numel` elements whose values the caller writes before reading them (they
    are zeros here, but torch.empty's, the fallback, are not)."""
    mapped = _mapped(numel, dtype)
    return torch.empty(numel, dtype=dtype) if mapped is None else mapped


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros of `shape` whose pages are faulted in when first written, not here."""
    mapped = _mapped(math.prod(shape), dtype)
    return torch.zeros(shape, dtype=dtype) if mapped is None else mapped.view(shape)
