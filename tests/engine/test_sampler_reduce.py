"""The device-side reduction of logits before the copy (sampling/reduce.py), proven on the CPU: the
torch hash has the numpy hash's bits, and the draw from a row's few candidates is the full draw's
token (or, where the candidates cannot prove it, no answer: the full row is drawn instead)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minisgl_backend import SamplingParams
from minisgl_backend.sampling.reduce import draw_reduced, hash_uniform_torch, margin, reduce_rows, reducible
from minisgl_backend.sampling.sampler import SampleRow, hash_uniform, sample

pytestmark = pytest.mark.gpu_sim
# On a GPU machine the device side runs on the GPU (scripts/gpu_check.sh): the same bits are expected.
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_the_torch_hash_has_the_numpy_hashs_bits():
    """Seeds across the whole uint64 range (the top bit set too), any position, any token id."""
    rng = np.random.default_rng(0)
    seeds = [0, 1, 2**63 - 1, 2**63, 2**64 - 1, *(int(s) * 2 + 1 for s in rng.integers(0, 2**63, 4))]
    positions = [0, 1, 7, 123456, 2**31, 5, 99, 4096, 3]
    ids = np.stack([rng.integers(0, 300000, 64) for _ in seeds])
    ids[0, :3] = [0, 1, 262143]
    want = hash_uniform(np.array(seeds, dtype=np.uint64), np.array(positions), ids)
    seeds_i64 = torch.tensor([s - 2**64 if s >= 2**63 else s for s in seeds])
    got = (
        hash_uniform_torch(
            seeds_i64.to(DEV), torch.tensor(positions, device=DEV), torch.from_numpy(ids).to(DEV)
        )
        .cpu()
        .numpy()
    )
    assert np.array_equal(got.view(np.uint64), want.view(np.uint64))


def _rows(n: int, rng: np.random.Generator) -> list[SampleRow]:
    """Greedy rows and random rows at temperatures from near-greedy to very flat, each with its own
    seed (some above 2**63) and position."""
    temps = [0.0, 1e-4, 0.3, 0.7, 1.0, 1.5, 10.0, 100.0]
    rows = []
    for i in range(n):
        seed = int(rng.integers(0, 2**63)) * (2 if i % 3 == 0 else 1) + i
        p = SamplingParams(temperature=temps[i % len(temps)], seed=seed, max_tokens=1)
        rows.append(SampleRow(p, seed, int(rng.integers(0, 100000)), []))
    return rows


def _adversarial(vocab: int, rng: np.random.Generator) -> np.ndarray:
    """Rows a draw finds hard: random logits at several scales, flat rows, a tie at the maximum
    (many tokens, and three far apart: the first must win), one spike, ties everywhere (few distinct
    values), huge and tiny magnitudes."""
    r = [
        rng.standard_normal(vocab),
        rng.standard_normal(vocab) * 10,
        rng.standard_normal(vocab) * 0.01,
        np.zeros(vocab),  # flat
        np.full(vocab, -3.5),  # flat, negative
        np.where(np.arange(vocab) % 97 == 5, 4.0, rng.standard_normal(vocab)),  # ties at the max
        np.where(np.arange(vocab) == vocab - 1, 50.0, rng.standard_normal(vocab)),  # a spike at the end
        np.where(np.isin(np.arange(vocab), [vocab - 1, vocab // 2, 1]), 6.0, rng.standard_normal(vocab)),
        rng.integers(0, 3, vocab).astype(np.float64),  # ties everywhere
        rng.standard_normal(vocab) * 1e4,
        np.full(vocab, -1e30),
    ]
    return np.stack(r).astype(np.float32)


def _full_scores(logits: np.ndarray, row: SampleRow) -> np.ndarray:
    """Every token's score as the full draw computes it (sampler._draw; the logits for greedy)."""
    if row.params.greedy:
        return logits.astype(np.float64)
    ids = np.arange(logits.shape[0])
    u = hash_uniform(np.array([row.seed]), np.array([row.position]), ids[None, :])[0]
    return logits.astype(np.float64) / row.params.temperature - np.log(-np.log(u))


@pytest.mark.parametrize("vocab", [3, 50, 4096, 262144], ids=lambda v: f"vocab{v}")
def test_the_reduced_draw_is_the_full_draw(vocab):
    """Every row the candidates answer gets the full draw's token. A row goes back to the full row
    only where its best score does not clear the best one left out by the margin: a greedy maximum
    tied beyond the candidates, or scores so large that the noise is lost in their rounding."""
    k = 8
    rng = np.random.default_rng(vocab)
    logits = _adversarial(vocab, rng)
    logits = np.concatenate([logits] * 2)  # each logits row under two different keys
    rows = _rows(logits.shape[0], rng)
    full = sample(logits, rows)
    cand = reduce_rows(torch.from_numpy(logits).to(DEV), rows, k=k).numpy()
    # A device may return tied candidates in any order: the answer must not depend on it.
    perm = np.stack([rng.permutation(cand.ids.shape[1]) for _ in rows])
    cand = cand._replace(
        ids=np.take_along_axis(cand.ids, perm, 1), logits=np.take_along_axis(cand.logits, perm, 1)
    )
    reduced = draw_reduced(cand, rows)
    answered = [i for i, t in enumerate(reduced) if t is not None]
    assert [reduced[i] for i in answered] == [full[i] for i in answered]
    for i, t in enumerate(reduced):
        if t is None:
            s = np.sort(_full_scores(logits[i], rows[i]))[::-1]
            assert vocab > k and s[0] - s[k] <= 2 * margin(s[k]), f"row {i} was provable"
    assert len(answered) >= 0.75 * len(rows)


def test_rows_whose_draw_needs_more_than_scores_take_the_full_row():
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((6, 100)).astype(np.float32)
    kinds = [
        dict(top_k=5),
        dict(top_p=0.9),
        dict(min_p=0.1),
        dict(logit_bias={3: 5.0}),
        dict(presence_penalty=0.5),
        dict(logprobs=2),
    ]
    rows = [SampleRow(SamplingParams(temperature=0.8, seed=1, **kw), 1, 5, []) for kw in kinds]
    assert not any(reducible(r) for r in rows)
    assert draw_reduced(reduce_rows(torch.from_numpy(logits).to(DEV), rows).numpy(), rows) == [None] * 6


def test_a_dropped_candidate_is_caught_not_drawn():
    """With its best candidate removed, a row cannot prove its draw: the bound (the best score left
    out) is now above every kept score, so the answer is None, never a wrong token."""
    rng = np.random.default_rng(4)
    logits = rng.standard_normal((8, 500)).astype(np.float32)
    rows = _rows(8, rng)
    cand = reduce_rows(torch.from_numpy(logits).to(DEV), rows, k=8)
    lost = torch.tensor([_full_scores(logits[i], r).max() for i, r in enumerate(rows)])
    dropped = type(cand)(cand.ids[:, 1:], cand.logits[:, 1:], lost)  # the lost best now bounds the rest
    assert draw_reduced(dropped.numpy(), rows) == [None] * 8
