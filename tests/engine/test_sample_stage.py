"""The sampling stage over a step's full host logits (executor/sample_stage.py): a decode step's
samples read their rows in place instead of a copy of the whole logits, so nothing the stage runs
may write into the rows it is given."""

from __future__ import annotations

import numpy as np
import torch

from minisgl_backend import SamplingParams
from minisgl_backend.executor.sample_stage import sample_iteration, take_rows
from minisgl_backend.executor.token_table import TokenTable
from minisgl_backend.iteration import IterationInputs, SampleSpec
from tests.helpers import sampling_inputs

VOCAB = 500


def _inputs(params: list[SamplingParams]) -> IterationInputs:
    return sampling_inputs(tuple(SampleSpec(i, 100 + i, i, 8, 4, p, 7) for i, p in enumerate(params)))


def test_consecutive_rows_are_read_in_place_and_any_others_by_index():
    logits = np.random.default_rng(0).standard_normal((6, VOCAB)).astype(np.float32)
    for rows in ([0, 1, 2, 3, 4, 5], [2, 3, 4], [5], [1, 3], [4, 2], [0, 0]):
        got = take_rows(logits, rows)
        np.testing.assert_array_equal(got, logits[rows])
        consecutive = rows == list(range(rows[0], rows[0] + len(rows)))
        assert np.shares_memory(got, logits) == consecutive, rows


def test_processors_and_penalties_leave_the_logits_and_the_logprobs_alone():
    # A processor may write into the row it is handed (the public contract gives it a torch view),
    # and a logit bias changes its row. The stage passes the step's rows without copying them, so
    # both must work on a copy: else the change would reach the logits that the other rows and the
    # reported logprobs are read from.
    def only_token_5(output_ids: list[int], row: torch.Tensor) -> torch.Tensor:
        row[:5] = -float("inf")
        row[6:] = -float("inf")
        return row

    rng = np.random.default_rng(1)
    logits = rng.standard_normal((3, VOCAB)).astype(np.float32)
    logits[:, 5] = -4.0  # far below every row's best token: only the processor makes row 0 draw it
    before = logits.copy()
    params = [
        SamplingParams(temperature=0, logprobs=2, logits_processors=[only_token_5]),
        SamplingParams(temperature=0, logprobs=2),
        SamplingParams(temperature=0, logit_bias={7: 50.0}),
    ]
    table = TokenTable(3, 64)
    for r in range(3):
        table.write_prompt(r, [1, 2, 3, 4])
    # the bias alone (processors copy the rows they run on, penalties then work on that copy)
    alone = sample_iteration(_inputs(params[1:]), logits[1:], table)
    assert alone.sampled == {100: int(before[1].argmax()), 101: 7}
    np.testing.assert_array_equal(logits, before)
    out = sample_iteration(_inputs(params), logits, table)

    assert not out.errors
    np.testing.assert_array_equal(logits, before)
    assert out.sampled == {100: 5, 101: int(before[1].argmax()), 102: 7}
    # logprobs are the model's: token 5 keeps its (low) rank under the unprocessed row
    raw = before[0].astype(np.float64)
    want = raw[5] - raw.max() - np.log(np.exp(raw - raw.max()).sum())
    assert out.logprobs[100].token_id == 5
    assert abs(out.logprobs[100].logprob - want) < 1e-6
    assert out.logprobs[100].rank > 1
