"""The preallocated KV pool: per layer, one K and one V tensor of num_blocks x block_size slots."""

from __future__ import annotations

import torch

from minisgl_backend.errors import ConfigError
from minisgl_backend.pages import huge_page_zeros


def kv_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def kv_blocks_from_device_memory(
    free_bytes: int, total_bytes: int, utilization: float, bytes_per_block: int
) -> int:
    """KV blocks for a pool sized from device memory, as vLLM's `gpu_memory_utilization`: this engine
    may hold `utilization` x the device's total memory, and what is already in use when the pool is
    sized (its weights, other processes, the allocator's cache: total - free) comes out of that share.
    The share left over, (1 - utilization) x total, is headroom for the forward's activations.
    ConfigError when not one block fits, naming the knobs that change it."""
    used = total_bytes - free_bytes
    budget = int(utilization * total_bytes) - used
    blocks = budget // bytes_per_block if budget > 0 else 0
    if blocks < 1:
        gib = 2**30
        raise ConfigError(
            f"gpu_memory_utilization={utilization} leaves no room for one KV block of "
            f"{bytes_per_block} bytes: {used / gib:.2f} GiB of the device's {total_bytes / gib:.2f} GiB are "
            f"in use (weights, other processes); raise gpu_memory_utilization (at most 1) or set "
            "kv_cache_memory_gb or num_blocks"
        )
    return int(blocks)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """One layer's K or V pool, zeros. On the CPU its pages are faulted in as blocks are first
    written rather than all at start-up (pages.huge_page_zeros), and lie on huge pages where the
    platform gives them: attention's walks over scattered blocks take fewer TLB misses."""
    if torch.device(device).type == "cpu":
        return huge_page_zeros(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


class KVCache:
    """K/V storage. Slot s of the pool is (block s // block_size, offset s % block_size)."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = [_zeros(shape, dtype, device) for _ in range(num_layers)]
        self.v = [_zeros(shape, dtype, device) for _ in range(num_layers)]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' K/V ([N, kv_heads, head_dim]) at flat slot indices [N]."""
        self.k[layer].view(-1, *k.shape[1:]).index_copy_(0, slots, k)
        self.v[layer].view(-1, *v.shape[1:]).index_copy_(0, slots, v)

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of whole blocks: block_tables [..., nb] -> [..., nb * block_size, kv_heads, head_dim]."""
        flat = block_tables.reshape(-1)
        shape = (*block_tables.shape[:-1], -1, *self.k[layer].shape[-2:])
        return self.k[layer].index_select(0, flat).view(shape), self.v[layer].index_select(0, flat).view(
            shape
        )
