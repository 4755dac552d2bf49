"""The batch the model runs (`ForwardBatch`: decode rows, then prefill chunks, flattened) and what
attention reads of it: a chunk's mask, the decode rows' block tables and mask in a sliding-window
layer, and the per-row tables of the native paged attention."""

from __future__ import annotations

from typing import NamedTuple

import torch

from minisgl_backend.arith import cdiv
from minisgl_backend.iteration import PrefillChunk


class ForwardBatch(NamedTuple):
    """A flattened mixed batch: decode rows first (one token each), then prefill chunks."""

    input_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    slot_mapping: torch.Tensor  # [N] flat KV slot each new token writes
    num_decode: int
    decode_block_tables: torch.Tensor | None  # [B, nb] (padded with block 0)
    decode_mask: torch.Tensor | None  # [B, 1, 1, nb * block_size] bool: key j < context length
    prefill_chunks: tuple[PrefillChunk, ...]
    logits_index: torch.Tensor  # [M] token rows whose next-token logits are wanted


def chunk_mask(chunk: PrefillChunk, window: int | None = None) -> torch.Tensor | None:
    """[length, ctx_len] mask of one prompt chunk: query at position q sees key j iff j <= q (and,
    in a sliding-window layer, j > q - window). None when plain causal attention over the chunk's
    own keys is exact (a first chunk no longer than the window)."""
    prefix = chunk.ctx_len - chunk.length
    if prefix == 0 and (window is None or chunk.length <= window):
        return None
    dev = chunk.block_table.device  # built where attention runs: the block table is already there
    q = torch.arange(prefix, chunk.ctx_len, device=dev)[:, None]
    k = torch.arange(chunk.ctx_len, device=dev)[None, :]
    mask = k <= q
    if window is not None:
        mask &= k > q - window
    return mask


def row_tables(batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tables, row_table, positions) for cpu_kernels.paged_attention over every row of the batch:
    the decode rows' block tables, then one per prefill chunk, zero-padded to one width."""
    n, nd = batch.input_ids.shape[0], batch.num_decode
    decode = None if batch.decode_block_tables is None else batch.decode_block_tables[:nd].to(torch.int64)
    if not batch.prefill_chunks and decode is not None:  # a decode step: its tables as they are
        return decode.contiguous(), torch.arange(n), batch.positions[:n]
    row_table = torch.empty(n, dtype=torch.int64)
    row_table[:nd] = torch.arange(nd)
    widths = [chunk.block_table.shape[0] for chunk in batch.prefill_chunks]
    width = max(widths + ([decode.shape[1]] if decode is not None else []), default=1)
    tables = torch.zeros(max(nd + len(batch.prefill_chunks), 1), width, dtype=torch.int64)
    if decode is not None:
        tables[:nd, : decode.shape[1]] = decode
    for i, chunk in enumerate(batch.prefill_chunks):
        row_table[chunk.start : chunk.start + chunk.length] = nd + i
        tables[nd + i, : chunk.block_table.shape[0]] = chunk.block_table
    return tables, row_table, batch.positions[:n]


def decode_window(
    batch: ForwardBatch, window: int | None, block_size: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(block tables, mask) the decode rows attend through. In a sliding-window layer only the
    blocks that hold a row's last `window` keys are gathered, and the mask keeps keys at positions
    p - window < j <= p (p: the row's position); otherwise batch.decode_block_tables / decode_mask."""
    tables = batch.decode_block_tables
    if window is None or tables is None:
        return tables, batch.decode_mask
    dev = tables.device
    span = cdiv(window - 1, block_size) + 1  # most blocks that `window` consecutive keys touch
    pos = batch.positions[: batch.num_decode].to(dev)[:, None]  # [B, 1]
    first = torch.clamp(pos - window + 1, min=0) // block_size
    if span >= tables.shape[1]:  # the whole context is no longer than the window's blocks
        first = torch.zeros_like(first)
        span = tables.shape[1]
    idx = first + torch.arange(span, device=dev)[None, :]  # [B, span] block index within each row
    # Indices past a row's table read some valid block; their keys lie after p, so they are masked.
    narrow = tables.gather(1, idx.clamp(max=tables.shape[1] - 1))
    keys = (idx[:, :, None] * block_size + torch.arange(block_size, device=dev)).view(len(pos), -1)
    mask = (keys <= pos) & (keys > pos - window)
    return narrow, mask[:, None, None, :]
