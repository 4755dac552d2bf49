"""Decode steps over static buffers at batch-size buckets: what a CUDA graph replays.

A CUDA graph replays fixed kernels on fixed addresses, so a decode batch of n rows runs as the graph
of the smallest bucket b >= n whose inputs sit in static buffers of b rows:

- the batch's rows are written into rows [0, n) of the bucket's buffers (ids, positions, KV slots,
  block tables and mask, widened to the widest table a sequence can have);
- rows [n, b) are padding: token 0 at position 0, writing its K/V into slot 0 of a padding block
  that no request is ever given (the engine keeps it out of the block pool) and attending to that
  slot only, so a padding row never writes or reads a request's KV;
- the logits of the batch's `logits_index` rows are gathered out of the bucket's static output
  into a fresh tensor, which the next replay cannot overwrite while its copy to the host is pending.

`DecodeGraphs` does all of that, and runs each bucket either eagerly (the model's forward on the
static buffers: on the CPU, to test exactly this host logic) or by replaying the bucket's captured
`torch.cuda.CUDAGraph` (`capture()`, on a GPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from minisgl_backend.kvcache.storage import KVCache
from minisgl_backend.model.batch import ForwardBatch
from minisgl_backend.model.llama import CausalLM


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, then every 8 up to `max_num_seqs` (which is always
    one): the padding of a batch is under 8 rows past 8, and under half of it below."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    small = [b for b in (1, 2, 4) if b < max_num_seqs]
    return sorted({*small, *range(8, max_num_seqs, 8), max_num_seqs})


class _Bucket:
    """The static buffers of one bucket (and its graph and output once captured)."""

    def __init__(self, rows: int, width: int, block_size: int, device: torch.device) -> None:
        def z(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.rows = rows
        self.ids, self.positions, self.slots = z(rows), z(rows), z(rows)
        self.tables = z(rows, width)
        self.mask = z(rows, 1, 1, width * block_size, dtype=torch.bool)
        self.logits_index = torch.arange(rows, device=device)
        self.graph: Any = None  # torch.cuda.CUDAGraph once captured
        self.out: torch.Tensor | None = None  # the graph's static logits

    def batch(self) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.ids,
            positions=self.positions,
            slot_mapping=self.slots,
            num_decode=self.rows,
            decode_block_tables=self.tables,
            decode_mask=self.mask,
            prefill_chunks=(),
            logits_index=self.logits_index,
        )


class DecodeGraphs:
    """Decode batches of up to max(buckets) rows run at their bucket over static buffers.

    model, kv: the engine's; pad_block: a KV block no request is given (padding rows write there);
    max_blocks: the widest block table a sequence can have (cdiv(max_model_len, block_size))."""

    def __init__(
        self,
        model: CausalLM,
        kv: KVCache,
        buckets: Sequence[int],
        max_blocks: int,
        pad_block: int,
    ) -> None:
        if not buckets or min(buckets) < 1:
            raise ValueError(f"buckets must be positive batch sizes, got {list(buckets)}")
        if not 0 <= pad_block < kv.num_blocks:
            raise ValueError(f"pad_block {pad_block} is not a block of the pool (0..{kv.num_blocks - 1})")
        self.model, self.kv = model, kv
        self.max_blocks = max_blocks
        self.pad_block = pad_block
        device = kv.k[0].device
        self.buckets = {b: _Bucket(b, max_blocks, kv.block_size, device) for b in sorted(set(buckets))}
        self.captured = False

    def bucket_for(self, batch: ForwardBatch) -> int | None:
        """The bucket a batch runs at, or None when it does not fit one (prefill rows, more rows than
        the largest bucket, a wider table): it then runs eagerly as it is. Shapes only: no sync."""
        n = batch.input_ids.shape[0]
        tables = batch.decode_block_tables
        if (
            batch.prefill_chunks
            or batch.num_decode != n
            or tables is None
            or tables.shape[1] > self.max_blocks
        ):
            return None
        return next((b for b in self.buckets if b >= n), None)

    def _write(self, bucket: _Bucket, batch: ForwardBatch) -> None:
        """The batch into rows [0, n) of the bucket's buffers, padding rows into [n, b)."""
        n = batch.input_ids.shape[0]
        tables, mask = batch.decode_block_tables, batch.decode_mask
        assert tables is not None and mask is not None  # bucket_for took only decode batches
        w = tables.shape[1]
        bucket.ids[:n].copy_(batch.input_ids)
        bucket.positions[:n].copy_(batch.positions)
        bucket.slots[:n].copy_(batch.slot_mapping)
        bucket.tables[:n, :w].copy_(tables)
        bucket.mask[:n, ..., : mask.shape[-1]].copy_(mask)
        # Past a row's own blocks: the padding block, masked out (valid ids for any gather).
        bucket.tables[:n, w:] = self.pad_block
        bucket.mask[:n, ..., mask.shape[-1] :] = False
        bucket.ids[n:] = 0
        bucket.positions[n:] = 0
        bucket.slots[n:] = self.pad_block * self.kv.block_size
        bucket.tables[n:] = self.pad_block
        bucket.mask[n:] = False
        bucket.mask[n:, ..., 0] = True  # a padding row attends to its own key: no empty softmax

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [len(batch.logits_index), vocab] of a batch that bucket_for fits, by replaying
        its bucket's graph when captured, else the model's forward on the bucket's buffers."""
        size = self.bucket_for(batch)
        if size is None:
            raise ValueError("run() takes a decode batch that bucket_for() fits; run others eagerly")
        bucket = self.buckets[size]
        self._write(bucket, batch)
        if bucket.graph is not None:
            bucket.graph.replay()
            out = bucket.out
            assert out is not None  # captured with the graph
        else:
            out = self.model(bucket.batch(), self.kv)
        return out.index_select(0, batch.logits_index)

    def capture(self, stream: Any) -> None:
        """Capture every bucket's graph (largest first, sharing one memory pool), on a GPU. Each
        bucket's forward runs once eagerly first on `stream` (a warm-up: lazy initialisation and
        the Triton kernels' compilation must not happen inside a capture). The padding rows write
        only the padding block, so capturing with the buffers as they are disturbs no request."""
        pool = None
        stream.wait_stream(torch.cuda.current_stream())  # the static buffers were made there
        for size in sorted(self.buckets, reverse=True):
            bucket = self.buckets[size]
            self._write_idle(bucket)
            with torch.cuda.stream(stream):
                self.model(bucket.batch(), self.kv)
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                bucket.out = self.model(bucket.batch(), self.kv)
            pool = graph.pool()
            bucket.graph = graph
        self.captured = True

    def _write_idle(self, bucket: _Bucket) -> None:
        """Every row a padding row (what a capture runs on)."""
        bucket.ids.zero_()
        bucket.positions.zero_()
        bucket.slots.fill_(self.pad_block * self.kv.block_size)
        bucket.tables.fill_(self.pad_block)
        bucket.mask.zero_()
        bucket.mask[..., 0] = True
