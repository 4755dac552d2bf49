"""What one iteration asks of the executor, built on the scheduler thread from lengths only.

The scheduler never needs a sampled token to plan: every input token is named by
(token-table row, absolute position) and gathered on the compute stream when the iteration runs,
after the iteration that samples it has written it (S6). Prompt tokens enter the table through
`prompt_writes`, applied in stream order by the iteration that first reads them.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from minisgl_backend.model.llama import PrefillRow
from minisgl_backend.scheduler.scheduler import Batch
from minisgl_backend.types import SamplingParams


class SampleSpec(NamedTuple):
    logits_row: int
    req_key: int  # id(request): how the scheduler matches the result
    token_row: int
    position: int  # absolute position of the drawn token; written to token_table[token_row, position]
    prompt_len: int  # logits processors see token_table[token_row, prompt_len:position]
    params: SamplingParams
    seed: int


class ScoreSpec(NamedTuple):
    """A prompt logprob scored inside (chunked) prefill: logits at index-1 score prompt[index]."""

    logits_row: int
    req_key: int
    prompt_index: int
    token_id: int
    num_top: int


class IterationInputs(NamedTuple):
    iteration: int
    depends_on: int  # newest earlier iteration whose sampled tokens this one reads (0: none)
    token_rows: torch.Tensor  # [N] token-table row of each input token
    positions: torch.Tensor  # [N]
    slot_mapping: torch.Tensor  # [N]
    prompt_writes: tuple[tuple[int, list[int]], ...]  # (row, tokens) written at positions 0..len-1
    num_decode: int
    decode_block_tables: torch.Tensor | None
    decode_mask: torch.Tensor | None
    prefill_rows: tuple[PrefillRow, ...]
    logits_index: torch.Tensor
    samples: tuple[SampleSpec, ...]
    scores: tuple[ScoreSpec, ...]


def _slots(table: list[int], start: int, end: int, block_size: int) -> np.ndarray:
    pos = np.arange(start, end)
    return np.asarray(table, dtype=np.int64)[pos // block_size] * block_size + pos % block_size


def build_inputs(batch: Batch, block_size: int) -> IterationInputs:
    """Flatten a planned Batch: decode rows first (one token each), then prefill chunks."""
    bs = block_size
    rows: list[int] = []
    pos: list[int] = []
    slots: list[np.ndarray] = []
    logits_index: list[int] = []
    samples: list[SampleSpec] = []
    scores: list[ScoreSpec] = []

    def add_sample(token_index: int, row) -> None:
        req = row.req
        samples.append(
            SampleSpec(
                len(logits_index),
                id(req),
                req.row,
                row.start + row.length,
                len(req.prompt_ids),
                req.params,
                req.seed,
            )
        )
        logits_index.append(token_index)

    ctx = [row.start + 1 for row in batch.decode]
    for i, row in enumerate(batch.decode):
        rows.append(row.req.row)
        pos.append(row.start)
        slots.append(_slots(row.req.block_table, row.start, row.start + 1, bs))
        add_sample(i, row)
    dec_tables = dec_mask = None
    if batch.decode:
        nb = -(-max(ctx) // bs)
        tables = np.zeros((len(ctx), nb), dtype=np.int64)
        for i, row in enumerate(batch.decode):
            t = row.req.block_table[: -(-ctx[i] // bs)]
            tables[i, : len(t)] = t
        dec_tables = torch.from_numpy(tables)
        dec_mask = (torch.arange(nb * bs)[None, :] < torch.tensor(ctx)[:, None])[:, None, None, :]

    prefill: list[PrefillRow] = []
    for row in batch.prefill:
        req, s, n = row.req, row.start, row.length
        base, end = len(rows), s + n
        rows.extend([req.row] * n)
        pos.extend(range(s, end))
        slots.append(_slots(req.block_table, s, end, bs))
        prefill.append(PrefillRow(base, n, end, torch.tensor(req.block_table[: -(-end // bs)])))
        for p in range(s, end):
            if req.needs_prompt_logprob(p + 1):
                scores.append(
                    ScoreSpec(
                        len(logits_index), id(req), p + 1, req.prompt_ids[p + 1], req.params.prompt_logprobs
                    )
                )
                logits_index.append(base + p - s)
        if row.samples:
            add_sample(base + n - 1, row)

    return IterationInputs(
        iteration=batch.iteration,
        depends_on=batch.depends_on,
        token_rows=torch.tensor(rows, dtype=torch.int64),
        positions=torch.tensor(pos, dtype=torch.int64),
        slot_mapping=torch.from_numpy(np.concatenate(slots)),
        prompt_writes=batch.prompt_writes,
        num_decode=len(batch.decode),
        decode_block_tables=dec_tables,
        decode_mask=dec_mask,
        prefill_rows=tuple(prefill),
        logits_index=torch.tensor(logits_index, dtype=torch.int64),
        samples=tuple(samples),
        scores=tuple(scores),
    )
