"""Big CPU buffers in mappings of their own (minisgl_backend.pages): the packed weights and the KV
pool live there."""

from __future__ import annotations

import gc

import torch

from minisgl_backend.pages import HUGE_PAGE, huge_page_empty, huge_page_zeros


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_huge_page_tensor_outlives_every_name_of_its_mapping():
    t = huge_page_empty(3 << 20, torch.bfloat16)  # 6 MB: an mmap'd region of its own
    gc.collect()
    t.fill_(1.5)
    assert t.shape == (3 << 20,) and t.is_contiguous()
    assert t.float().sum().item() == 1.5 * (3 << 20)
    assert huge_page_empty(10, torch.bfloat16).shape == (10,)  # small: torch.empty


def test_zeroed_pool_costs_no_memory_until_written():
    """A KV pool of zeros is resident only where it has been written: allocating 256 MB of it
    leaves the process's resident memory where it was (torch.zeros would write every page), and
    its values are zeros where read and what was written where written."""
    before = _resident_bytes()
    pool = huge_page_zeros((64, 1024, 2048), torch.bfloat16)  # 256 MB
    grown = _resident_bytes() - before
    assert grown < 16 << 20, f"allocating the pool made {grown >> 20} MB resident"
    assert pool.shape == (64, 1024, 2048) and pool.dtype == torch.bfloat16 and pool.is_contiguous()
    pool[3, 5].fill_(2.0)
    assert pool[3, 5].float().sum().item() == 2.0 * 2048
    assert pool[3].float().abs().sum().item() == 2.0 * 2048  # the rest of the block: zeros
    assert pool[63, -1].float().abs().sum().item() == 0.0
    small = huge_page_zeros((3, 5), torch.float32)  # below one huge page: torch.zeros
    assert small.shape == (3, 5) and not small.any()
    assert HUGE_PAGE == 2 << 20
