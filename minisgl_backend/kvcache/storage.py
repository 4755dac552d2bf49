"""The preallocated KV pool: per layer, one K and one V tensor of num_blocks x block_size slots."""

from __future__ import annotations

import torch


def kv_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


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
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

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
