"""repetition / presence / frequency penalties and logit_bias (vLLM's semantics): the math against a
hand-computed reference, validation, and the engine end to end on the tiny model (greedy sees them,
logit_bias forces a token, the history comes from the token table exactly, batch invariance)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minisgl_backend import Engine, EngineConfig, InvalidSamplingParamsError, SamplingParams
from minisgl_backend.sampling.penalties import apply_penalties, penalise_row
from minisgl_backend.sampling.sampler import SampleRow, sample
from minisgl_backend.tools.determinism import Grid, Workload, run_check
from tests.helpers import QUIET

# ---------------------------------------------------------------------------------------- the math
LOGITS = np.array([2.0, -1.0, 0.5, -0.5, 0.0, 3.0], dtype=np.float32)
PROMPT = [0, 1]
OUTPUT = [2, 2, 3]


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        # nothing: the logits as they are
        ({}, [2.0, -1.0, 0.5, -0.5, 0.0, 3.0]),
        # repetition 2 over prompt + output {0, 1, 2, 3}: positive / 2, others * 2; 4, 5 untouched
        ({"repetition_penalty": 2.0}, [1.0, -2.0, 0.25, -1.0, 0.0, 3.0]),
        # a penalty below 1 rewards repeats (the same rule)
        ({"repetition_penalty": 0.5}, [4.0, -0.5, 1.0, -0.25, 0.0, 3.0]),
        # frequency 0.5 x count in the OUTPUT only (token 2 twice, 3 once; the prompt's 0, 1 are free)
        ({"frequency_penalty": 0.5}, [2.0, -1.0, -0.5, -1.0, 0.0, 3.0]),
        # presence 0.25 once per distinct output token
        ({"presence_penalty": 0.25}, [2.0, -1.0, 0.25, -0.75, 0.0, 3.0]),
        # negative values reward instead
        ({"presence_penalty": -1.0, "frequency_penalty": -0.5}, [2.0, -1.0, 2.5, 1.0, 0.0, 3.0]),
        # logit_bias adds
        ({"logit_bias": ((4, 1.0), (5, -10.0))}, [2.0, -1.0, 0.5, -0.5, 1.0, -7.0]),
        # all at once, in vLLM's order: bias (0: 2+1=3), repetition (3/2=1.5; 1: -2; 2: 0.25; 3: -1),
        # frequency (2: 0.25-1=-0.75; 3: -1-0.5=-1.5), presence (2: -1.0; 3: -1.75)
        (
            {
                "logit_bias": ((0, 1.0), (5, -1.0)),
                "repetition_penalty": 2.0,
                "frequency_penalty": 0.5,
                "presence_penalty": 0.25,
            },
            [1.5, -2.0, -1.0, -1.75, 0.0, 2.0],
        ),
    ],
)
def test_penalties_match_a_hand_computed_reference(kwargs, expected):
    out = penalise_row(LOGITS, PROMPT, OUTPUT, **kwargs)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, np.array(expected, dtype=np.float32))
    np.testing.assert_array_equal(LOGITS, [2.0, -1.0, 0.5, -0.5, 0.0, 3.0])  # the input is not changed


def _vllm_reference(logits, prompts, outputs, rep, freq, pres, bias):
    """vLLM's batched formula (v1 Sampler: logit bias, then model_executor.layers.utils.apply_penalties
    with the repetition kernel's divide / multiply), in torch, padded with vocab_size like vLLM."""
    x = torch.tensor(logits, dtype=torch.float32)
    n, v = x.shape
    for i, b in enumerate(bias):
        for t, val in b:
            x[i, t] += val

    def bins(seqs):
        width = max(1, max(len(s) for s in seqs))
        padded = torch.tensor([list(s) + [v] * (width - len(s)) for s in seqs], dtype=torch.long)
        counts = torch.zeros((n, v + 1), dtype=torch.long).scatter_add_(1, padded, torch.ones_like(padded))
        return counts[:, :v], counts[:, :v] > 0

    _, prompt_mask = bins(prompts)
    out_counts, out_mask = bins(outputs)
    r = torch.tensor(rep, dtype=torch.float32)[:, None].expand(n, v)
    penalised = torch.where(x > 0, x / r, x * r)
    x = torch.where(prompt_mask | out_mask, penalised, x)
    x -= torch.tensor(freq, dtype=torch.float32)[:, None] * out_counts
    x -= torch.tensor(pres, dtype=torch.float32)[:, None] * out_mask
    return x.numpy()


def test_random_batches_match_vllms_batched_formula_row_by_row():
    rng = np.random.default_rng(0)
    n, vocab = 12, 64
    logits = (rng.standard_normal((n, vocab)) * 3).astype(np.float32)
    rows, prompts, outputs, rep, freq, pres, bias = [], [], [], [], [], [], []
    for i in range(n):
        prompts.append(rng.integers(0, vocab, rng.integers(1, 20)).tolist())
        outputs.append(rng.integers(0, vocab, rng.integers(0, 30)).tolist())
        params = SamplingParams(
            repetition_penalty=float(rng.choice([1.0, 0.7, 1.3, 2.0])),
            frequency_penalty=float(rng.choice([0.0, -0.4, 1.1])),
            presence_penalty=float(rng.choice([0.0, 0.6, -2.0])),
            logit_bias={int(t): float(rng.uniform(-100, 100)) for t in rng.integers(0, vocab, i % 3)},
        )
        rows.append(SampleRow(params, i, 5, outputs[-1], prompts[-1]))
        rep.append(params.repetition_penalty)
        freq.append(params.frequency_penalty)
        pres.append(params.presence_penalty)
        bias.append(params.logit_bias)
    errors: dict[int, Exception] = {}
    ours = apply_penalties(logits, rows, errors)
    assert not errors
    ref = _vllm_reference(logits, prompts, outputs, rep, freq, pres, bias)
    np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-5)
    # Each row is its own: alone, or in any order among the others, it comes out the same, bitwise.
    order = rng.permutation(n)
    shuffled = apply_penalties(logits[order], [rows[i] for i in order], {})
    for j, i in enumerate(order):
        alone = apply_penalties(logits[i : i + 1], [rows[i]], {})
        np.testing.assert_array_equal(alone[0], ours[i])
        np.testing.assert_array_equal(shuffled[j], ours[i])


def test_rows_without_penalties_are_not_copied_and_failed_rows_are_skipped():
    logits = np.zeros((2, 8), dtype=np.float32)
    plain = SampleRow(SamplingParams(), 1, 3, [1, 1])
    assert apply_penalties(logits, [plain, plain], {}) is logits
    biased = SampleRow(SamplingParams(logit_bias={3: 5}), 1, 3, [])
    errors: dict[int, Exception] = {0: RuntimeError("its processor failed")}
    out = apply_penalties(logits, [biased, biased], errors)
    assert out[0, 3] == 0 and out[1, 3] == 5 and list(errors) == [0]


def test_greedy_draw_is_the_argmax_of_the_penalised_logits():
    logits = np.array([[0.0, 5.0, 4.0, 1.0]], dtype=np.float32)
    greedy = SamplingParams(temperature=0, frequency_penalty=2.0)
    row = SampleRow(greedy, 1, 9, [1])  # token 1 was drawn once: 5 - 2 = 3 < 4
    assert sample(apply_penalties(logits, [row], {}), [row]) == [2]
    assert sample(logits, [SampleRow(SamplingParams(temperature=0), 1, 9, [1])]) == [1]


def test_logit_bias_outside_the_vocabulary_fails_only_its_row():
    logits = np.zeros((2, 8), dtype=np.float32)
    rows = [
        SampleRow(SamplingParams(logit_bias={8: 1.0}), 1, 3, []),
        SampleRow(SamplingParams(logit_bias={7: 1.0}), 1, 3, []),
    ]
    errors: dict[int, Exception] = {}
    out = apply_penalties(logits, rows, errors)
    assert list(errors) == [0] and isinstance(errors[0], InvalidSamplingParamsError)
    assert "logit_bias token ids out of range [0, 8)" in str(errors[0]) and "[8]" in str(errors[0])
    assert out[1, 7] == 1.0


# ---------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"repetition_penalty": 0}, r"repetition_penalty must be a finite number > 0"),
        ({"repetition_penalty": -1.5}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"repetition_penalty": "1.2"}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be a finite number in \[-2, 2\]"),
        ({"presence_penalty": -2.01}, "presence_penalty"),
        ({"presence_penalty": True}, "presence_penalty"),
        ({"frequency_penalty": -3}, r"frequency_penalty must be a finite number in \[-2, 2\]"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"logit_bias": {5: 101}}, r"logit_bias\[5\] must be a finite number in \[-100, 100\]"),
        ({"logit_bias": {5: float("-inf")}}, r"logit_bias\[5\]"),
        ({"logit_bias": {5: "1"}}, r"logit_bias\[5\]"),
        ({"logit_bias": {-1: 1.0}}, r"logit_bias keys must be token ids \(ints >= 0\), got -1"),
        ({"logit_bias": {"5": 1.0}}, r"logit_bias keys must be token ids"),
        ({"logit_bias": {2.0: 1.0}}, r"logit_bias keys must be token ids"),
        ({"logit_bias": [(1, 2.0), (1, 3.0)]}, "names token id 1 more than once"),
        ({"logit_bias": 5}, "logit_bias must be a dict of token id"),
        ({"logit_bias": [1, 2]}, "logit_bias must be a dict of token id"),
    ],
)
def test_bad_penalty_values_are_typed_errors_naming_the_field(kwargs, match):
    with pytest.raises(InvalidSamplingParamsError, match=match):
        SamplingParams(**kwargs)
    with pytest.raises(InvalidSamplingParamsError, match=match):
        SamplingParams.from_dict(kwargs)


def test_penalty_fields_normalise_and_stay_hashable():
    p = SamplingParams.from_dict(
        {
            "repetition_penalty": 2,
            "presence_penalty": -2,
            "frequency_penalty": 2,
            "logit_bias": {9: 1, 3: -100},
        }
    )
    assert p.repetition_penalty == 2.0 and isinstance(p.repetition_penalty, float)
    assert (p.presence_penalty, p.frequency_penalty) == (-2.0, 2.0)
    assert p.logit_bias == ((3, -100.0), (9, 1.0)) and p.penalised
    assert p == SamplingParams(
        repetition_penalty=2.0, presence_penalty=-2, frequency_penalty=2, logit_bias=[(9, 1.0), (3, -100)]
    )
    hash(p)
    assert SamplingParams(logit_bias={np.int64(4): np.float32(0.5)}).logit_bias == ((4, 0.5),)
    neutral = SamplingParams(logit_bias={}, repetition_penalty=1, presence_penalty=0, frequency_penalty=0)
    assert not neutral.penalised and neutral.logit_bias == ()


# ---------------------------------------------------------------------------------------- the engine
PROMPTS = ["The capital of France is", "a b c d e f", "Hello", list(range(300, 320)), "Once upon a time"]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    # Deterministic: a fresh prefill's logits are bitwise a decode's (the stepwise reference).
    cfg = EngineConfig(
        model=str(tiny_model_dir), **QUIET, num_blocks=128, max_model_len=512, deterministic=True
    )
    with Engine(cfg) as eng:
        yield eng


GREEDY = {"temperature": 0, "max_tokens": 16, "ignore_eos": True}


def _ids(engine) -> list[list[int]]:
    return [list(engine.tokenizer.encode(p)) if isinstance(p, str) else p for p in PROMPTS]


def _gen(engine, prompts, **kw):
    kw = {**GREEDY, "max_tokens": 24, **kw}
    return [o.token_ids for o in engine.generate(prompts, SamplingParams(**kw), use_tqdm=False)]


def test_greedy_with_a_large_frequency_penalty_never_repeats_a_token(engine):
    plain = _gen(engine, PROMPTS)
    penalised = _gen(engine, PROMPTS, frequency_penalty=2.0)
    assert any(len(set(t)) < len(t) for t in plain)  # without it the tiny model repeats somewhere
    assert all(len(set(t)) == len(t) for t in penalised)
    assert penalised != plain


def test_repetition_penalty_counts_prompt_tokens(engine):
    """A bias makes the prompt's own tokens likely; greedy then reuses some of them, unless a large
    repetition penalty (which, unlike presence / frequency, covers the prompt) pushes them down."""
    ids = _ids(engine)
    runs = {}
    for rep in (1.0, 100.0):
        params = [
            SamplingParams(**GREEDY, repetition_penalty=rep, logit_bias={t: 6.0 for t in p}) for p in ids
        ]
        runs[rep] = [o.token_ids for o in engine.generate(ids, params, use_tqdm=False)]
    assert sum(len(set(o) & set(p)) for p, o in zip(ids, runs[1.0])) >= 5
    for p, o in zip(ids, runs[100.0]):
        assert not set(o) & set(p) and len(set(o)) == len(o), (p, o)


def _stepwise_reference(engine, ids, sampling, rep, freq, pres, biases, steps):
    """Each request one token at a time: a fresh request for prompt + output so far draws the next
    token (same seed, same absolute position: the same keyed noise), its logits changed by vLLM's
    formula in a processor that knows the history itself (not through the token table)."""

    def proc(prompt, out, bias):
        def fn(_output_ids, logits):
            ref = _vllm_reference(logits.numpy()[None, :], [prompt], [out], [rep], [freq], [pres], [bias])
            return torch.from_numpy(ref[0])

        return fn

    outs: list[list[int]] = [[] for _ in ids]
    for _ in range(steps):
        params = [
            SamplingParams(**sampling, max_tokens=1, ignore_eos=True, logits_processors=[proc(p, list(o), b)])
            for p, o, b in zip(ids, outs, biases)
        ]
        for o, r in zip(outs, engine.generate([p + o for p, o in zip(ids, outs)], params, use_tqdm=False)):
            o.extend(r.token_ids)
    return outs


@pytest.mark.parametrize("penalties", [(1.7, 1.5, 1.0), (1.0, 2.0, 2.0)], ids=["all", "output-only"])
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "top_p": 0.9, "seed": 7}])
def test_engine_penalties_equal_vllms_formula_recomputed_step_by_step(engine, sampling, penalties):
    """The history the sampling stage reads from the token table (the prompt, then every output token
    before this position) is the request's own. The tiny model's distribution is flat, so a bias makes
    a few tokens likely (the prompt's first token among them) for the penalties to act on."""
    (rep, freq, pres), steps = penalties, 12
    ids = _ids(engine)
    biases = [tuple(sorted({p[0]: 7.0, 13: 8.0, 200: 6.0, 4000: -5.0}.items())) for p in ids]
    knobs = {"repetition_penalty": rep, "frequency_penalty": freq, "presence_penalty": pres}
    common = {"max_tokens": steps, "ignore_eos": True, **sampling}
    ours = engine.generate(
        ids, [SamplingParams(**common, **knobs, logit_bias=b) for b in biases], use_tqdm=False
    )
    ours = [o.token_ids for o in ours]
    bias_only = engine.generate(ids, [SamplingParams(**common, logit_bias=b) for b in biases], use_tqdm=False)
    assert ours == _stepwise_reference(engine, ids, sampling, rep, freq, pres, biases, steps)
    assert any(a != b.token_ids for a, b in zip(ours, bias_only))  # the penalties change the draws


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 3}])
def test_logit_bias_100_forces_its_token_every_step(engine, sampling):
    outs = engine.generate(
        PROMPTS[:3], SamplingParams(max_tokens=12, logit_bias={4242: 100}, **sampling), use_tqdm=False
    )
    assert all(o.token_ids == [4242] * 12 for o in outs)
    # -100 bans the token greedy would pick
    first = _gen(engine, PROMPTS[:1], max_tokens=1)[0][0]
    assert _gen(engine, PROMPTS[:1], max_tokens=1, logit_bias={first: -100})[0][0] != first


def test_logit_bias_outside_the_vocabulary_is_a_typed_error_and_the_engine_goes_on(engine):
    good = engine.submit("Hello", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    with pytest.raises(InvalidSamplingParamsError, match=rf"out of range \[0, {engine.vocab_size}\)"):
        engine.submit("Hello", SamplingParams(max_tokens=4, logit_bias={engine.vocab_size: 1.0}))
    assert len(good.result(timeout=30).token_ids) == 4
    counts = engine.drain(timeout=30)
    assert counts["running"] == counts["waiting"] == 0


def test_penalised_outputs_survive_preemption(tiny_model_dir):
    """Under a pool too small for all requests (preemption, recompute), each penalised request's
    output equals its output in a roomy engine: the history is the token table's, not a counter."""
    kw = dict(model=str(tiny_model_dir), block_size=4, chunk_size=4, max_model_len=40, num_threads=1)
    kw.update(prefix_cache="off", stats_interval_s=0, max_num_seqs=4)
    params = [
        SamplingParams(temperature=0, max_tokens=28, ignore_eos=True, repetition_penalty=1.5),
        SamplingParams(temperature=0.8, seed=5, max_tokens=28, ignore_eos=True, frequency_penalty=1.0),
        SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, presence_penalty=1.5),
    ]
    prompts = [[11, 12, 13, 14, 15], [21, 22], [31]]
    with Engine(EngineConfig(**kw, num_blocks=64)) as roomy:
        expected = [o.token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    with Engine(EngineConfig(**kw, num_blocks=10)) as tight:
        outs = tight.generate(prompts, params, use_tqdm=False)
    assert sum(o.num_preemptions for o in outs) > 0
    assert [o.token_ids for o in outs] == expected


@pytest.mark.slow
def test_penalised_requests_are_batch_and_chunk_invariant(tiny_model_dir):
    """Each penalised request gives one output under chunk sizes 4 and 16 and max_num_seqs 1 (it
    runs alone) or 16 (beside random fillers, in shuffled arrival orders)."""
    grid = Grid.from_dict(
        {
            "fillers": 4,
            "base": {"stats_interval_s": 0, "num_blocks": 96, "max_model_len": 256, "num_threads": 1},
            "axes": {"chunk_size": [4, 16], "max_num_seqs": [1, 16]},
            "prefill_check": False,
        }
    )
    workload = Workload.from_dict(
        {
            "max_tokens": 12,
            "logprobs": 1,
            "sampling": {
                "greedy-rep": {"temperature": 0, "repetition_penalty": 1.3},
                "greedy-freq-bias": {"temperature": 0, "frequency_penalty": 1.5, "logit_bias": {13: 2.5}},
                "seeded-all": {
                    "temperature": 0.9,
                    "top_p": 0.95,
                    "seed": 5,
                    "repetition_penalty": 1.2,
                    "presence_penalty": 0.8,
                    "frequency_penalty": -0.5,
                },
            },
            "prompts": ["The capital of France is", list(range(300, 340)), "Hi"],
        }
    )
    report = run_check(grid, workload, {"model": str(tiny_model_dir), "deterministic": True})
    print(report.format_table())
    assert report.points_run == 4 and len(report.requests) == 9
    assert report.num_differing == 0 and all(r.points == 4 for r in report.requests)


def test_a_repetition_penalty_below_float32_range_stays_finite(engine):
    """repetition_penalty=5e-324 (valid: > 0) rounds to 0 in float32: the penalised logits stay
    finite or capped, a masked -inf stays -inf, and a top-p draw over them returns tokens."""
    row = np.array([2.0, -1.0, -np.inf, 0.5], dtype=np.float32)
    out = penalise_row(row, [0, 1, 2], [], repetition_penalty=5e-324)
    assert not np.isnan(out).any()
    assert out[0] == np.finfo(np.float32).max and out[2] == -np.inf and out[3] == 0.5
    ids = _ids(engine)[:2]
    params = SamplingParams(temperature=0.8, top_p=0.5, seed=1, max_tokens=4, repetition_penalty=5e-324)
    outs = engine.generate(ids, params, use_tqdm=False)
    assert all(len(o.token_ids) == 4 and o.finish_reason == "length" for o in outs)
