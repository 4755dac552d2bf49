"""The types one iteration carries between the scheduler and the executor, at the bottom of the
package so that neither side imports the other.

The scheduler plans an iteration from lengths only and flattens it into `IterationInputs`
(`scheduler/inputs.py`); the executor runs the model on it and its sampling stage answers with an
`IterationOutput`. Every input token is named by (token-table row, absolute position) and gathered
when the iteration runs, after the iteration that samples it has written it: step N+1 of a
sequence reads the token step N sampled, never an unwritten slot. Requests appear here only as
opaque keys (`req_key`, the scheduler's id of the request), so the executor, the sampler and the
model know nothing of requests, queues or the Engine.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from minisgl_backend.types import SamplingParams, TokenLogprob


class PrefillChunk(NamedTuple):
    """One prompt chunk of the flattened batch: its tokens are [start, start+length) of the batch
    and end at context length ctx_len (a later chunk, ctx_len > length, also attends to the
    prefix already in the KV cache)."""

    start: int
    length: int
    ctx_len: int
    block_table: torch.Tensor  # [ceil(ctx_len / block_size)] block ids


class SampleSpec(NamedTuple):
    """One token to draw: from logits row `logits_row`, for position `position` of a request."""

    logits_row: int
    req_key: int  # how the scheduler matches the result to its request
    table_row: int  # the request's token-table row
    position: int  # absolute position of the drawn token; written to token_table[table_row, position]
    prompt_len: int  # logits processors see token_table[table_row, prompt_len:position]
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
    """What one iteration asks of the executor: decode tokens first (one per request), then the
    prompt chunks. Immutable once built: the executor's threads read it while the scheduler plans on."""

    iteration: int
    depends_on: int  # newest earlier iteration whose sampled tokens this one reads (0: none)
    table_rows: torch.Tensor  # [N] token-table row of each input token
    positions: torch.Tensor  # [N]
    slot_mapping: torch.Tensor  # [N]
    prompt_writes: tuple[tuple[int, list[int]], ...]  # (table row, tokens) written at 0..len-1
    num_decode: int
    decode_block_tables: torch.Tensor | None
    decode_mask: torch.Tensor | None
    prefill_chunks: tuple[PrefillChunk, ...]
    logits_index: torch.Tensor
    samples: tuple[SampleSpec, ...]
    scores: tuple[ScoreSpec, ...]


class IterationOutput(NamedTuple):
    """What one executed iteration reports back to the scheduler, keyed by `req_key`."""

    sampled: dict[int, int]  # drawn token
    logprobs: dict[int, TokenLogprob]  # logprob of the drawn token (when asked)
    prompt_logprobs: list[tuple[int, int, TokenLogprob]]  # (req_key, prompt index, logprob)
    errors: dict[int, Exception]  # why sampling / scoring that request failed (RequestFailedError)
