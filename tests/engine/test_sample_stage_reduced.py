"""The sampling stage over reduced logits (executor/sample_stage.py, ReducedLogits and
reduce_iteration): one iteration's output is the same as over the full logits, while only the rows
that need it are copied in full, and a row its candidates cannot prove is fetched afterwards."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minisgl_backend import SamplingParams
from minisgl_backend.executor.sample_stage import ReducedLogits, reduce_iteration, sample_iteration
from minisgl_backend.executor.token_table import TokenTable
from minisgl_backend.iteration import IterationInputs, SampleSpec, ScoreSpec
from tests.helpers import sampling_inputs

pytestmark = pytest.mark.gpu_sim
DEV = "cuda" if torch.cuda.is_available() else "cpu"
VOCAB = 3000

# (params, reducible): what a batch mixes
KINDS = [
    (SamplingParams(temperature=0), True),
    (SamplingParams(temperature=0.8, seed=11), True),
    (SamplingParams(temperature=1.3, seed=2**63 + 5), True),
    (SamplingParams(temperature=0.7, top_p=0.9, seed=3), False),
    (SamplingParams(temperature=0.7, top_k=20, min_p=0.05, seed=4), False),
    (SamplingParams(temperature=0.9, presence_penalty=0.8, logit_bias={7: 40.0}, seed=5), False),
    (SamplingParams(temperature=0, logprobs=3), False),
    (SamplingParams(temperature=0.6, seed=6, logprobs=0), False),
]


def _iteration(n: int, rng: np.random.Generator) -> tuple[IterationInputs, np.ndarray]:
    """n samples of the KINDS in turn (row 0 flat and greedy: its candidates cannot prove its tie)
    and two prompt-logprob scores, over random logits rows."""
    logits = (rng.standard_normal((n + 2, VOCAB)) * 3).astype(np.float32)
    logits[0] = 1.5  # flat: a greedy draw there is a tie across the whole vocabulary
    samples = tuple(
        SampleSpec(i, 100 + i, i, 40 + i, 5, KINDS[i % len(KINDS)][0], KINDS[i % len(KINDS)][0].seed or i)
        for i in range(n)
    )
    scores = (ScoreSpec(n, 900, 3, 17, 2), ScoreSpec(n + 1, 901, 4, 23, 0))
    inp = sampling_inputs(samples, scores)
    return inp, logits


def _table(n: int) -> TokenTable:
    table = TokenTable(n, 128)
    for r in range(n):
        table.write_prompt(r, [(7 * r + j) % VOCAB for j in range(40 + r)])
    return table


def test_the_reduced_iteration_gives_the_full_iterations_output():
    n = 3 * len(KINDS)
    inp, logits = _iteration(n, np.random.default_rng(0))
    want = sample_iteration(inp, logits, _table(n))
    assert not want.errors and len(want.sampled) == n and len(want.prompt_logprobs) == 2

    device_logits = torch.from_numpy(logits).to(DEV)
    cand, full_rows, full = reduce_iteration(inp, device_logits)
    fetched: list[list[int]] = []

    def fetch(rows: list[int]) -> np.ndarray:
        fetched.append(rows)
        return device_logits[rows].cpu().numpy()

    reduced = ReducedLogits(cand.numpy(), dict(zip(full_rows, full.cpu().numpy())), fetch)
    got = sample_iteration(inp, reduced, _table(n))
    assert got == want
    # Copied in full: the rows whose draw is not reducible, and the scored rows; nothing else.
    expect = {s.logits_row for s in inp.samples if not KINDS[s.logits_row % len(KINDS)][1]}
    assert set(full_rows) == expect | {n, n + 1}
    # Fetched afterwards: only the flat greedy row, whose tie its candidates cannot settle.
    assert fetched == [[0]] and reduced.fetched == 1
