"""The CPU sampler: keyed noise makes draws independent of batch composition."""

import math

import numpy as np
import pytest
import torch

from minisgl_backend import InvalidSamplingParamsError, SamplingParams
from minisgl_backend.model import cpu_kernels
from minisgl_backend.sampling.sampler import (
    SampleRow,
    _candidates,
    apply_processors,
    hash_uniform,
    sample,
    token_logprobs,
)


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


def _ranking_row(rng: np.random.Generator, kind: int, vocab: int) -> np.ndarray:
    """A float64 row for the top-k selection tests, by kind 0-4: a normal spread at one of four
    scales, integer ties, flat, 60% masked, one huge outlier."""
    if kind == 0:
        return rng.standard_normal(vocab) * rng.choice([1e-3, 1.0, 30.0, 1e5])
    if kind == 1:
        return rng.integers(0, 4, vocab).astype(np.float64)
    if kind == 2:
        return np.full(vocab, -2.5)
    x = rng.standard_normal(vocab) * (1 if kind == 3 else 40)
    if kind == 3:
        x[rng.random(vocab) < 0.6] = -np.inf
    else:
        x[int(rng.integers(vocab))] = 1e7
    return x


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
        x = _ranking_row(rng, kind, vocab)
        want = np.lexsort((np.arange(vocab), -x))[:width]
        got = _best_ids(x, width)
        assert np.array_equal(got, want), (kind, vocab, width)


def _full_draw(x32: np.ndarray, temperature: float, seed: int, position: int) -> int:
    """The keyed draw without filters over the whole row, as numpy computes every score."""
    x = x32.astype(np.float64) / temperature
    u = hash_uniform(np.array([seed]), np.array([position]), np.arange(x.size)[None, :])[0]
    return int(np.argmax(x - np.log(-np.log(u))))


def _adversarial_row(rng: np.random.Generator, kind: int, vocab: int) -> np.ndarray:
    if kind == 0:
        x = rng.standard_normal(vocab) * rng.choice([1e-3, 1.0, 30.0, 1e4])
    elif kind == 1:  # integer logits: ties everywhere, the noise alone breaks them
        x = rng.integers(0, 4, vocab).astype(np.float64)
    elif kind == 2:  # flat
        x = np.full(vocab, -2.5)
    elif kind == 3:  # masked (a grammar, logit_bias)
        x = rng.standard_normal(vocab) * 5
        keep = int(rng.integers(vocab))
        x[(rng.random(vocab) < 0.9) & (np.arange(vocab) != keep)] = -np.inf
    elif kind == 4:  # one token far ahead, the rest a peaked model's tail
        x = rng.standard_normal(vocab) * 2
        x[int(rng.integers(vocab))] = 40.0
    elif kind == 5:  # a few near the top
        x = rng.standard_normal(vocab) - 20
        x[rng.integers(0, vocab, 4)] = rng.standard_normal(4) * 0.01
    else:  # every token masked but one
        x = np.full(vocab, -np.inf)
        x[int(rng.integers(vocab))] = 1.5
    return x.astype(np.float32)


@pytest.mark.skipif(
    not cpu_kernels.avx512_available(),
    reason="the native screen of the keyed draw runs under the AVX-512 kernel families",
)
def test_screened_draw_is_the_full_draw_on_adversarial_rows():
    """A sampled row without filters is drawn from the native screen of its scores (one pass over the
    vocabulary) instead of numpy's ~20. Its token must be exactly the full draw's on every row:
    wide and narrow spreads, ties, flat and masked rows, one token far ahead, a near tie at the top,
    vocabularies from 1 to 256k, tiny and large temperatures, keys past 2**63. The screen reports
    its winner's noise bit for bit as hash_uniform, and a bound at or above every other token's
    score; and it must serve nearly every row (not hand them all back to the full draw)."""
    from minisgl_backend.sampling.sampler import _screened_draw

    rng = np.random.default_rng(11)
    served = 0
    trials = 700
    for trial in range(trials):
        sizes = [1, 2, 17, 512, 513, 3000, 49152, 262144]
        vocab = sizes[trial % 8] if trial < 640 else int(rng.integers(1, 5000))
        x = _adversarial_row(rng, trial % 7, vocab)
        temperature = float(rng.choice([1e-4, 0.3, 0.7, 1.0, 5.0]))
        seed = int(rng.integers(0, 2**63)) + (2**63 if trial % 3 == 0 else 0)
        position = int(rng.integers(0, 2**40))
        row = _row(SamplingParams(temperature=temperature), seed, position)
        want = _full_draw(x, temperature, seed, position)
        assert sample(x[None, :], [row])[0] == want, (trial, vocab, temperature)
        token, score, bound, u, nan = cpu_kernels.keyed_draw_screen(x, temperature, seed, position)
        assert token == want and not nan, (trial, vocab)
        assert u == hash_uniform(np.array([seed]), np.array([position]), np.array([[token]]))[0, 0]
        scores = x.astype(np.float64) / temperature - np.log(
            -np.log(hash_uniform(np.array([seed]), np.array([position]), np.arange(vocab)[None, :])[0])
        )
        assert abs(score - scores[token]) <= 1e-12 * max(1.0, abs(score))
        others = np.delete(scores, token)
        if others.size and np.isfinite(others).any():
            assert bound >= others.max() - 1e-12 * max(1.0, abs(bound)), (trial, vocab, bound, others.max())
        served += _screened_draw(x, row) is not None
    assert served >= 0.98 * trials


@pytest.mark.parametrize("bad", [(float("nan"), 0), (float("inf"), 1), (float("-inf"), 2)])
def test_screened_draw_hands_nan_infinite_and_empty_rows_to_the_full_draw(bad):
    """A NaN or +inf logit, or a row of -inf only, takes the full draw (which picks the NaN, picks
    the +inf, or fails the row), whether or not the screen runs."""
    value, where = bad
    x = np.random.default_rng(3).standard_normal(1000).astype(np.float32)
    x[where * 100] = value
    if value == float("-inf"):
        x[:] = value
    row = _row(SamplingParams(temperature=0.8), 5, 9)
    errors: dict = {}
    got = sample(x[None, :], [row], errors)[0]
    if errors:
        assert value == float("-inf") and "no token to draw" in str(errors[0])
    else:
        assert got == where * 100 == _full_draw(x, 0.8, 5, 9)


def test_draw_takes_a_screened_token_only_when_its_score_proves_it(monkeypatch):
    """The draw recomputes the screened winner's score exactly and keeps it only when it clears the
    bound the screen reports on every other token: a screen that names the runner-up, or reports a
    bound above the winner, must still give the full draw's token; a right answer is taken without
    the full draw."""
    from minisgl_backend.sampling import sampler

    x = (np.random.default_rng(5).standard_normal(5000) * 3).astype(np.float32)
    seed, position, t = 77, 12, 0.9
    u_all = hash_uniform(np.array([seed]), np.array([position]), np.arange(x.size)[None, :])[0]
    scores = x.astype(np.float64) / t - np.log(-np.log(u_all))
    order = np.argsort(-scores)
    best, runner = int(order[0]), int(order[1])
    row = _row(SamplingParams(temperature=t), seed, position)
    answers = {
        "runner-up named": (runner, scores[runner], scores[best], u_all[runner], False),
        "bound above the winner": (best, scores[best], scores[best] + 1.0, u_all[best], False),
        "right": (best, scores[best], scores[runner], u_all[best], False),
    }
    full_draws = []
    real_hash = sampler.hash_uniform
    monkeypatch.setattr(sampler, "hash_uniform", lambda *a: full_draws.append(1) or real_hash(*a))
    for name, answer in answers.items():
        monkeypatch.setattr(cpu_kernels, "keyed_draw_screen", lambda *a, answer=answer: answer)
        full_draws.clear()
        assert sample(x[None, :], [row])[0] == best, name
        assert bool(full_draws) == (name != "right"), name


def test_top_p_and_min_p_keep_the_full_sorts_nucleus_however_wide():
    """top-p / min-p look at the best 1,024 tokens first and widen by steps until their cut falls
    inside: on rows flat enough that the nucleus holds a few, thousands or most of a 49k vocabulary,
    the kept tokens are exactly those of a full sort of the row."""
    from minisgl_backend.sampling.sampler import _log_softmax

    rng = np.random.default_rng(2)
    vocab = 49152
    for scale in (4.0, 1.0, 0.3, 0.05, 0.0):
        logits = (rng.standard_normal(vocab) * scale).astype(np.float32)
        x = logits.astype(np.float64)  # the default temperature, 1
        order = np.lexsort((np.arange(vocab), -x))
        probs = np.exp(_log_softmax(x[None, :])[0][order])
        for p in (
            SamplingParams(top_p=0.9),
            SamplingParams(top_p=0.5, min_p=0.2),
            SamplingParams(min_p=0.01),
        ):
            keep = np.ones(vocab, dtype=bool)
            if p.top_p < 1.0:
                keep &= (np.cumsum(probs) - probs) < p.top_p
            if p.min_p > 0.0:
                keep &= probs >= p.min_p * probs[0]
            ids, vals = _candidates(logits, p)
            assert np.array_equal(ids, order[keep]) and np.array_equal(vals, x[ids]), (scale, p)


@pytest.mark.skipif(
    not cpu_kernels.avx512_available(),
    reason="the native prefilter selection runs under the AVX-512 kernel families",
)
def test_native_best_ids_are_the_full_sorts_on_adversarial_float32_rows():
    """The top-k / top-p prefilter's selection runs natively on the float32 logits: the `width` ids
    of largest logits / T by value, then the lower id, exactly as a full sort of numpy's float64
    x / T orders them. Spreads wide and narrow, integer ties, flat rows, masked rows, a huge
    outlier, and a temperature at which distinct float32 logits divide to the same float64 (ties
    made by the division, below the selection's cut too); a row it hands back (a NaN, a tie at its
    cut) is selected in numpy, with the same answer; and it serves nearly every row of continuous
    logits."""
    rng = np.random.default_rng(17)
    served = spread = 0
    for trial in range(1500):
        vocab = int(rng.integers(64, 6000)) if trial % 3 else 49152
        width = int(rng.integers(1, vocab // 4))
        kind = trial % 6
        if kind < 5:
            logits = _ranking_row(rng, kind, vocab)
        else:  # distinct tiny logits, which a huge temperature divides onto one float64 (0), and a few larger
            logits = (np.arange(vocab) % 7 + 1) * 1e-30
            logits[rng.random(vocab) < 0.05] = rng.uniform(1, 100)
        logits = logits.astype(np.float32)
        if trial % 50 == 7:
            logits[int(rng.integers(vocab))] = np.nan
        temperature = 1e300 if kind == 5 else float(rng.choice([1e-5, 0.7, 1.0, 3.0, 1e30]))
        x = logits.astype(np.float64) / temperature
        got = cpu_kernels.keyed_best_ids(logits, temperature, width)
        if np.isnan(logits).any():
            assert got is None
            continue
        want = np.lexsort((np.arange(vocab), -x))[:width]
        if got is not None:
            assert np.array_equal(got, want), (trial, kind, vocab, width, temperature)
        if kind in (0, 4):  # continuous rows: ties at the cut are rare
            spread += 1
            served += got is not None
        p = SamplingParams(temperature=temperature, top_k=width)
        assert np.array_equal(_candidates(logits, p)[0], want), (trial, kind, vocab, width, temperature)
    assert served >= 0.95 * spread


def test_top_p_decides_a_cut_within_the_native_normalisers_rounding_with_numpy(monkeypatch):
    """Without top-k, top-p's probabilities come from the whole row's normaliser, computed natively
    where the AVX-512 kernels run (within ~1e-15 of numpy's). A nucleus whose cut lies within that
    rounding must be decided by numpy's own log-softmax: a normaliser off by 1e-12 either way, on a
    row whose cumulative mass meets top_p exactly at a token, keeps what numpy keeps."""
    from minisgl_backend.sampling import sampler

    logits = np.full(5000, -np.inf, dtype=np.float32)
    logits[[3, 10, 400, 4000]] = 0.0  # four equal tokens: 0.25 each, the cut at 0.5 on the third
    p = SamplingParams(top_p=0.5)
    monkeypatch.setattr(cpu_kernels, "log_sum_exp", lambda x, t: None)
    want = sampler._candidates(logits, p)[0]
    for off in (1e-12, -1e-12):
        monkeypatch.setattr(cpu_kernels, "log_sum_exp", lambda x, t, off=off: (0.0, float(np.log(4.0)) + off))
        assert np.array_equal(sampler._candidates(logits, p)[0], want), off


@pytest.mark.skipif(
    not cpu_kernels.avx512_available(), reason="the native normaliser runs under the AVX-512 kernel families"
)
def test_native_normaliser_is_numpys_log_softmax_to_rounding():
    """The whole row's max of x / T is numpy's exactly and its log-sum within 1e-14: spreads at four
    scales, masked rows, tiny and huge temperatures, one token; a NaN or no finite maximum is None."""
    rng = np.random.default_rng(23)
    for trial in range(300):
        vocab = [1, 7, 4999, 49152, 262144][trial % 5]
        logits = _ranking_row(rng, trial % 5, vocab).astype(np.float32)
        if not np.isfinite(logits).any():
            logits[0] = 0.5
        temperature = float(rng.choice([1e-5, 0.7, 1.0, 3.0, 1e30]))
        m, log_sum = cpu_kernels.log_sum_exp(logits, temperature)
        x = logits.astype(np.float64) / temperature
        assert m == x.max(), trial
        want = float(np.log(np.exp(x - m).sum()))  # _log_softmax's log-sum
        assert abs(log_sum - want) <= 1e-14 * max(1.0, abs(want)), (trial, log_sum, want)
    assert cpu_kernels.log_sum_exp(np.array([0.0, np.nan], dtype=np.float32), 1.0) is None
    assert cpu_kernels.log_sum_exp(np.full(9, -np.inf, dtype=np.float32), 1.0) is None
