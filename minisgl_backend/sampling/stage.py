"""The sampling stage of one iteration (runs on the copy stream's worker, on the CPU: S16)."""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Iterable, TypeVar

import numpy as np

from minisgl_backend.executor.inputs import IterationInputs
from minisgl_backend.executor.token_table import TokenTable
from minisgl_backend.sampling.sampler import SampleRow, apply_processors, sample, token_logprobs
from minisgl_backend.scheduler.scheduler import StepOutput
from minisgl_backend.types import TokenLogprob

T = TypeVar("T")


def _group(items: Iterable[T], key: Callable[[T], int]) -> dict[int, list[T]]:
    groups: dict[int, list[T]] = defaultdict(list)
    for it in items:
        groups[key(it)].append(it)
    return groups


def sample_iteration(inp: IterationInputs, logits: np.ndarray, table: TokenTable) -> StepOutput:
    """Draw the tokens of one iteration from float32 logits [rows, vocab], write them into the token
    table (where the next iteration reads them) and score prompt logprobs."""
    sampled: dict[int, int] = {}
    logprobs: dict[int, TokenLogprob] = {}
    errors: dict[int, Exception] = {}
    specs = inp.samples
    if specs:
        rows = [
            SampleRow(s.params, s.seed, s.position,
                      table.history(s.token_row, s.prompt_len, s.position) if s.params.logits_processors else ())
            for s in specs
        ]
        processed, failed = apply_processors(logits[[s.logits_row for s in specs]], rows)
        errors = {specs[i].req_key: e for i, e in failed.items()}
        tokens = sample(processed, rows)
        table.write_drawn([s.token_row for s in specs], [s.position for s in specs], tokens)
        for s, tok in zip(specs, tokens):
            sampled[s.req_key] = tok
        want = [(s, tok) for s, tok in zip(specs, tokens) if s.params.logprobs is not None]
        for k, group in _group(want, lambda w: w[0].params.logprobs).items():
            lps = token_logprobs(logits[[s.logits_row for s, _ in group]], [t for _, t in group], k)
            logprobs.update((s.req_key, lp) for (s, _), lp in zip(group, lps))
    prompt: list[tuple[int, int, TokenLogprob]] = []
    for k, group in _group(inp.scores, lambda s: s.num_top).items():
        lps = token_logprobs(logits[[s.logits_row for s in group]], [s.token_id for s in group], k)
        prompt.extend((s.req_key, s.prompt_index, lp) for s, lp in zip(group, lps))
    return StepOutput(sampled, logprobs, prompt, errors)
