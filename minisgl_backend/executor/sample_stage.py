"""The sampling stage of one iteration: runs on the executor's copy worker, on the CPU:
sampling a row costs microseconds there and overlaps the next forward instead of adding to it.

It belongs to the executor (it reads the executor's token table and answers the executor's
iteration); the sampling math it calls lives in `sampling/`, which knows nothing of iterations."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import TypeVar

import numpy as np
import torch

from minisgl_backend.arith import int_bits
from minisgl_backend.errors import RequestFailedError
from minisgl_backend.executor.token_table import TokenTable
from minisgl_backend.iteration import IterationInputs, IterationOutput
from minisgl_backend.sampling.penalties import apply_penalties
from minisgl_backend.sampling.reduce import Candidates, draw_reduced, reduce_for_draw, reducible
from minisgl_backend.sampling.sampler import SampleRow, apply_processors, sample, token_logprobs
from minisgl_backend.types import TokenLogprob

T = TypeVar("T")


def _group(items: Iterable[T], key: Callable[[T], int]) -> dict[int, list[T]]:
    groups: dict[int, list[T]] = defaultdict(list)
    for it in items:
        groups[key(it)].append(it)
    return groups


def _scored(
    items: list[T],
    key: Callable[[T], int],
    score: Callable[[list[T], int], list[TokenLogprob]],
    req_key: Callable[[T], int],
    errors: dict[int, Exception],
    what: str,
) -> list[tuple[T, TokenLogprob]]:
    """Score `items` grouped by their number of alternatives; a group that fails is retried row by
    row so that only the failing requests get an entry in `errors`."""
    out: list[tuple[T, TokenLogprob]] = []
    for k, group in _group(items, key).items():
        try:
            out.extend(zip(group, score(group, k)))
            continue
        except Exception:  # noqa: BLE001 - isolate the failing row(s) below
            pass
        for it in group:
            try:
                out.extend(zip([it], score([it], k)))
            except Exception as e:  # noqa: BLE001 - fails that request alone
                err = RequestFailedError(f"{what} raised {e!r}")
                err.__cause__ = e
                errors.setdefault(req_key(it), err)
    return out


class ReducedLogits:
    """One iteration's logits as the host gets them when the device reduced them (reduce_iteration):
    each sample's draw candidates (sampling/reduce.py), the full rows known to be needed (rows
    whose draw is not reducible, logprobs and prompt scores), and `fetch`, which copies further full
    rows from the device (a row whose candidates could not prove its draw). Indexed by a list of
    logits rows, it gives those full rows, as the full numpy logits would."""

    def __init__(
        self,
        candidates: Candidates,
        full: dict[int, np.ndarray],
        fetch: Callable[[list[int]], np.ndarray],
    ) -> None:
        self.candidates = candidates  # numpy, one row per IterationInputs.samples entry
        self.full = full
        self.fetch = fetch
        self.fetched = 0  # rows fetched after the fact (their draws were not provable)

    def __getitem__(self, rows: list[int]) -> np.ndarray:
        missing = sorted({r for r in rows if r not in self.full})
        if missing:
            self.full.update(zip(missing, self.fetch(missing)))
            self.fetched += len(missing)
        return np.stack([self.full[r] for r in rows])


def take_rows(logits: np.ndarray | ReducedLogits, rows: list[int]) -> np.ndarray:
    """logits[rows]: a view where the rows are consecutive (a decode step's samples are every row in
    order), so a step does not copy its whole logits (megabytes at a large vocabulary, on the path
    between one decode forward and the next) before reading them. Nothing downstream writes into the
    rows it is given: processors and penalties copy before they change a row."""
    if isinstance(logits, np.ndarray) and rows and rows == list(range(rows[0], rows[0] + len(rows))):
        return logits[rows[0] : rows[0] + len(rows)]
    return logits[rows]


def full_rows(inp: IterationInputs) -> list[int]:
    """The logits rows the host needs in full whatever the candidates say: the samples whose draw
    is not reducible (sampling/reduce.py), and every scored prompt row."""
    return sorted(
        {s.logits_row for s in inp.samples if not reducible(SampleRow(s.params, s.seed, s.position, ()))}
        | {s.logits_row for s in inp.scores}
    )


def draw_keys(inp: IterationInputs) -> list[torch.Tensor]:
    """Host tensors of what reduce_iteration reads: each sample's logits row, seed (the uint64's
    bits as int64), position and temperature (0 for greedy), then full_rows(inp). An executor
    uploads them with the iteration's inputs, so the reduction never copies from pageable memory."""
    specs = inp.samples
    temps = [0.0 if s.params.greedy else float(s.params.temperature) for s in specs]
    return [
        torch.tensor([s.logits_row for s in specs], dtype=torch.int64),
        torch.tensor([int_bits(s.seed) for s in specs], dtype=torch.int64),
        torch.tensor([s.position for s in specs], dtype=torch.int64),
        torch.tensor(temps, dtype=torch.float64),
        torch.tensor(full_rows(inp), dtype=torch.int64),
    ]


def reduce_iteration(
    inp: IterationInputs, logits: torch.Tensor, k: int = 8, keys: list[torch.Tensor] | None = None
) -> tuple[Candidates, list[int], torch.Tensor]:
    """On the logits' device: (each sample's draw candidates, the logits rows needed in full, those
    rows) for ReducedLogits. logits [rows, vocab] float32; keys: draw_keys(inp) on that device (made
    here from the host when None)."""
    dev = logits.device
    rows, seeds, positions, temps, full = (t.to(dev) for t in (keys or draw_keys(inp)))
    cand = reduce_for_draw(logits.index_select(0, rows), seeds, positions, temps, k)
    return cand, full_rows(inp), logits.index_select(0, full)


def sample_iteration(
    inp: IterationInputs, logits: np.ndarray | ReducedLogits, table: TokenTable
) -> IterationOutput:
    """Draw the tokens of one iteration from float32 logits [rows, vocab], write them into the token
    table (where the next iteration reads them) and score prompt logprobs.

    Per-request isolation: whatever goes wrong for one request (its logits processors, its draw,
    its logprobs) is reported in `errors` under its key and fails that request alone; every other
    row is delivered. A failed row still writes a placeholder token, so later in-flight iterations
    that read its row (their results are dropped) find it written instead of reading an unwritten slot."""
    sampled: dict[int, int] = {}
    logprobs: dict[int, TokenLogprob] = {}
    errors: dict[int, Exception] = {}
    specs = inp.samples
    if specs:
        rows = [
            SampleRow(
                s.params,
                s.seed,
                s.position,
                table.history(s.table_row, s.prompt_len, s.position)
                if s.params.logits_processors or s.params.penalised
                else (),
                # the table is written in stream order: [0, position) is exactly this row's history
                table.history(s.table_row, 0, s.prompt_len) if s.params.repetition_penalty != 1.0 else (),
            )
            for s in specs
        ]
        # Rows whose candidates prove their draw take it; the rest are drawn from their full rows
        # (every step below is row by row, so drawing a subset gives each row the same token).
        tokens: list[int | None] = [None] * len(specs)
        if isinstance(logits, ReducedLogits):
            tokens = draw_reduced(logits.candidates, rows)
        todo = [i for i, t in enumerate(tokens) if t is None]
        failed: dict[int, Exception] = {}
        if todo:
            sub = [rows[i] for i in todo]
            picked = take_rows(logits, [specs[i].logits_row for i in todo])
            processed, sub_failed = apply_processors(picked, sub)
            processed = apply_penalties(processed, sub, sub_failed)
            for i, t in zip(todo, sample(processed, sub, sub_failed)):
                tokens[i] = t
            failed = {todo[j]: e for j, e in sub_failed.items()}
        errors = {specs[i].req_key: e for i, e in failed.items()}
        drawn = [t for t in tokens if t is not None]
        assert len(drawn) == len(tokens), "every row drew a token: from its candidates or its full row"
        table.write_drawn([s.table_row for s in specs], [s.position for s in specs], drawn)
        for s, tok in zip(specs, drawn):
            if s.req_key not in errors:
                sampled[s.req_key] = tok
        want = [
            (s, tok)
            for s, tok in zip(specs, drawn)
            if s.params.logprobs is not None and s.req_key not in errors
        ]
        scored = _scored(
            want,
            lambda w: w[0].params.logprobs or 0,  # never None here: filtered above
            lambda g, k: token_logprobs(
                take_rows(logits, [s.logits_row for s, _ in g]), [t for _, t in g], k
            ),
            lambda w: w[0].req_key,
            errors,
            "logprobs",
        )
        logprobs.update((s.req_key, lp) for (s, _), lp in scored)
    scores = _scored(
        list(inp.scores),
        lambda s: s.num_top,
        lambda g, k: token_logprobs(take_rows(logits, [s.logits_row for s in g]), [s.token_id for s in g], k),
        lambda s: s.req_key,
        errors,
        "prompt logprobs",
    )
    prompt = [(s.req_key, s.prompt_index, lp) for s, lp in scores if s.req_key not in errors]
    return IterationOutput(sampled, logprobs, prompt, errors)
