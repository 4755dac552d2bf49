"""Flatten a planned Batch into the IterationInputs the executor runs, on the scheduler thread.

Built from lengths only: the scheduler never needs a sampled token to plan. Every input token is
named by (token-table row, absolute position) and gathered on the compute stream when the
iteration runs, after the iteration that samples it has written it (so planning never waits for
a draw, and no iteration reads a token before it exists). Prompt tokens enter the table through
`prompt_writes`, applied in stream order by the iteration that first reads them.
"""

from __future__ import annotations

import numpy as np
import torch

from minisgl_backend.arith import cdiv
from minisgl_backend.iteration import IterationInputs, PrefillChunk, SampleSpec, ScoreSpec
from minisgl_backend.scheduler.scheduler import Batch, BatchEntry


def _slots(table: list[int], start: int, end: int, block_size: int) -> np.ndarray:
    pos = np.arange(start, end)
    return np.asarray(table, dtype=np.int64)[pos // block_size] * block_size + pos % block_size


def build_inputs(batch: Batch, block_size: int) -> IterationInputs:
    """Decode entries first (one token each), then the prefill chunks."""
    table_rows: list[int] = []
    positions: list[int] = []
    slots: list[np.ndarray] = []
    logits_index: list[int] = []
    samples: list[SampleSpec] = []
    scores: list[ScoreSpec] = []

    def add_sample(token_index: int, entry: BatchEntry) -> None:
        req = entry.req
        end = entry.start + entry.length
        spec = SampleSpec(len(logits_index), id(req), req.row, end, len(req.prompt_ids), req.params, req.seed)
        samples.append(spec)
        logits_index.append(token_index)

    ctx = [entry.start + 1 for entry in batch.decode]
    for i, entry in enumerate(batch.decode):
        table_rows.append(entry.req.row)
        positions.append(entry.start)
        slots.append(_slots(entry.req.block_table, entry.start, entry.start + 1, block_size))
        add_sample(i, entry)
    dec_tables = dec_mask = None
    if batch.decode:
        nb = cdiv(max(ctx), block_size)
        tables = np.zeros((len(ctx), nb), dtype=np.int64)
        for i, entry in enumerate(batch.decode):
            t = entry.req.block_table[: cdiv(ctx[i], block_size)]
            tables[i, : len(t)] = t
        dec_tables = torch.from_numpy(tables)
        dec_mask = (torch.arange(nb * block_size)[None, :] < torch.tensor(ctx)[:, None])[:, None, None, :]

    chunks: list[PrefillChunk] = []
    for entry in batch.prefill:
        req, s, n = entry.req, entry.start, entry.length
        base, end = len(table_rows), s + n
        table_rows.extend([req.row] * n)
        positions.extend(range(s, end))
        slots.append(_slots(req.block_table, s, end, block_size))
        chunks.append(PrefillChunk(base, n, end, torch.tensor(req.block_table[: cdiv(end, block_size)])))
        for p in range(s, end):
            if req.needs_prompt_logprob(p + 1):
                k = req.params.prompt_logprobs or 0  # set: the request scores its prompt
                scores.append(ScoreSpec(len(logits_index), id(req), p + 1, req.prompt_ids[p + 1], k))
                logits_index.append(base + p - s)
        if entry.samples:
            add_sample(base + n - 1, entry)

    return IterationInputs(
        iteration=batch.iteration,
        depends_on=batch.depends_on,
        table_rows=torch.tensor(table_rows, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        slot_mapping=torch.from_numpy(np.concatenate(slots)),
        prompt_writes=batch.prompt_writes,
        num_decode=len(batch.decode),
        decode_block_tables=dec_tables,
        decode_mask=dec_mask,
        prefill_chunks=tuple(chunks),
        logits_index=torch.tensor(logits_index, dtype=torch.int64),
        samples=tuple(samples),
        scores=tuple(scores),
    )
