"""The CPU sampler: keyed noise makes draws independent of batch composition."""

import math

import numpy as np
import pytest
import torch

from minisgl_backend import InvalidSamplingParamsError, SamplingParams
from minisgl_backend.sampling.sampler import SampleRow, apply_processors, hash_uniform, sample, token_logprobs


def _row(params, seed=1, pos=10):
    return SampleRow(params, seed, pos, [])


def test_hash_is_pure_and_uniform():
    ids = np.arange(20000)[None, :]
    u1 = hash_uniform(np.array([5]), np.array([3]), ids)
    u2 = hash_uniform(np.array([5]), np.array([3]), ids)
    assert np.array_equal(u1, u2)
    assert 0 < u1.min() and u1.max() < 1
    assert abs(u1.mean() - 0.5) < 0.01
    other_pos = hash_uniform(np.array([5]), np.array([4]), ids)
    other_seed = hash_uniform(np.array([6]), np.array([3]), ids)
    assert (u1 != other_pos).mean() > 0.99 and (u1 != other_seed).mean() > 0.99


def test_seeded_draw_does_not_depend_on_batch_neighbours():
    logits = np.random.default_rng(0).standard_normal((6, 1000)).astype(np.float32)
    p = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=11)
    alone = sample(logits[2:3], [_row(p, 11, 42)])
    others = [_row(SamplingParams(temperature=1.0), s, 7) for s in range(6)]
    rows = others[:2] + [_row(p, 11, 42)] + others[3:]
    assert sample(logits, rows)[2] == alone[0]


def test_filters_reduce_to_greedy_and_draws_follow_the_distribution():
    logits = (np.random.default_rng(1).standard_normal((1, 50)) * 2).astype(np.float32)
    greedy = int(logits.argmax())
    for p in (SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams(min_p=1.0)):
        assert all(sample(logits, [_row(p, seed)])[0] == greedy for seed in range(20))
    # Frequencies over many seeds match softmax(logits / T).
    t = 0.7
    probs = torch.softmax(torch.from_numpy(logits[0]) / t, -1).numpy()
    p = SamplingParams(temperature=t)
    counts = np.zeros(50)
    n = 4000
    batch = np.repeat(logits, n, axis=0)
    for tok in sample(batch, [_row(p, seed, 3) for seed in range(n)]):
        counts[tok] += 1
    assert np.abs(counts / n - probs).max() < 0.03
    # top_p keeps the smallest set reaching the mass; the draw never leaves it.
    order = np.argsort(-probs)
    nucleus = set(order[: int(np.searchsorted(np.cumsum(probs[order]), 0.5)) + 1].tolist())
    assert set(sample(batch[:300], [_row(SamplingParams(top_p=0.5), s) for s in range(300)])) <= nucleus
    # top_k=3 never leaves the three most likely tokens.
    top3 = set(np.argsort(-logits[0])[:3].tolist())
    assert set(sample(batch[:300], [_row(SamplingParams(top_k=3), s) for s in range(300)])) <= top3


def test_token_logprobs_rank_and_top():
    logits = np.array([[0.0, 2.0, 1.0]], dtype=np.float32)
    (lp,) = token_logprobs(logits, [2], 2)
    ref = torch.log_softmax(torch.from_numpy(logits), -1)[0]
    assert lp.rank == 2 and math.isclose(lp.logprob, ref[2].item(), rel_tol=1e-6)
    assert [t for t, _ in lp.top] == [1, 2]


def test_failing_logits_processor_is_reported_per_row():
    def boom(_ids, _logits):
        raise RuntimeError("bad processor")

    def only_token_3(_ids, logits):
        out = torch.full_like(logits, float("-inf"))
        out[3] = 0
        return out

    logits = np.zeros((2, 10), dtype=np.float32)
    rows = [
        _row(SamplingParams(logits_processors=[boom])),
        _row(SamplingParams(logits_processors=[only_token_3])),
    ]
    processed, errors = apply_processors(logits, rows)
    assert list(errors) == [0] and "bad processor" in str(errors[0])
    assert sample(processed, rows)[1] == 3


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"seed": -1}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"logprobs": -1}, "logprobs"),
    ],
)
def test_invalid_sampling_params(kwargs, match):
    with pytest.raises(InvalidSamplingParamsError, match=match):
        SamplingParams(**kwargs)


def test_unknown_sampling_key_lists_valid_ones():
    with pytest.raises(
        InvalidSamplingParamsError, match="unknown sampling parameter.*temprature.*valid:.*temperature"
    ):
        SamplingParams.from_dict({"temprature": 0.5})


def test_best_ids_are_the_full_sorts_on_adversarial_rows():
    """The top-k / prefilter selection partitions only the tokens above a cut guessed from a strided
    sample. It must give exactly the full sort's first `width` ids (descending value, ascending id
    among equals): wide and narrow spreads, ties everywhere and at the cut, flat rows, masked
    (-inf) tokens, more width than finite tokens, one huge outlier, and the best tokens all on the
    sampled positions (the guessed cut too high: fewer than `width` above it)."""
    from minisgl_backend.sampling.sampler import _best_ids

    rng = np.random.default_rng(7)
    for trial in range(3000):
        vocab = int(rng.integers(1, 300)) if trial % 2 else int(rng.integers(1000, 6000))
        width = (
            int(rng.integers(1, vocab + 1)) if trial % 3 == 0 else int(rng.integers(1, min(vocab, 200) + 1))
        )
        kind = trial % 6
        if kind == 5:
            x = rng.standard_normal(vocab)
            x[::16] += 100.0
            want = np.lexsort((np.arange(vocab), -x))[:width]
            assert np.array_equal(_best_ids(x, width), want), (kind, vocab, width)
            continue
        if kind == 0:
            x = rng.standard_normal(vocab) * rng.choice([1e-3, 1.0, 30.0, 1e5])
        elif kind == 1:
            x = rng.integers(0, 4, vocab).astype(np.float64)
        elif kind == 2:
            x = np.full(vocab, -2.5)
        elif kind == 3:
            x = rng.standard_normal(vocab)
            x[rng.random(vocab) < 0.6] = -np.inf
        else:
            x = rng.standard_normal(vocab) * 40
            x[int(rng.integers(vocab))] = 1e7
        want = np.lexsort((np.arange(vocab), -x))[:width]
        got = _best_ids(x, width)
        assert np.array_equal(got, want), (kind, vocab, width)
