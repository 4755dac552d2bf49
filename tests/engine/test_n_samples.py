"""SamplingParams.n: n parallel samples of one prompt. Each sample's key against SplitMix64's
published outputs, each sample against an n = 1 request with that key run alone, the prompt's
blocks computed once (prefix metrics), streaming by sample index, abort and failure of a whole
request, every block FREE after drain, and the samples invariant across the scheduling grid."""

from __future__ import annotations

import pytest

from minisgl_backend import (
    Engine,
    EngineConfig,
    InvalidSamplingParamsError,
    RequestFailedError,
    SamplingParams,
)
from minisgl_backend.sampling.sampler import sample_key
from minisgl_backend.tools.determinism import Grid, Workload, run_check
from tests.helpers import QUIET, assert_drained

BLOCK = 16
PROMPT = list(range(300, 340))  # 40 tokens: two full blocks and an 8-token tail
COMMON = {"max_tokens": 10, "ignore_eos": True}


# ---------------------------------------------------------------------------------------- keys
@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "2", None])
def test_n_must_be_an_int_of_at_least_one(bad):
    with pytest.raises(InvalidSamplingParamsError, match=r"n must be an int >= 1"):
        SamplingParams(n=bad)
    with pytest.raises(InvalidSamplingParamsError, match=r"n must be an int >= 1"):
        SamplingParams.from_dict({"n": bad})


class _SplitMix64:
    """Vigna's reference generator, stepped: next() is the i-th output after i calls."""

    def __init__(self, seed: int) -> None:
        self.state = seed

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) % 2**64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
        return z ^ (z >> 31)


def test_sample_keys_are_the_seed_then_splitmix64_outputs():
    # SplitMix64 seeded with 0: its first three outputs as published with the reference code.
    assert [sample_key(0, i) for i in (1, 2, 3)] == [
        0xE220A8397B1DCDAF,
        0x6E789E6AA1B965F4,
        0x06C45D188009454F,
    ]
    for seed in (0, 7, 123456789, 2**63, 2**64 - 1):
        gen = _SplitMix64(seed)
        keys = [sample_key(seed, i) for i in range(6)]
        assert keys == [seed] + [gen.next() for _ in range(5)]
        assert len(set(keys)) == 6 and all(0 <= k < 2**64 for k in keys)


# ---------------------------------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    # Exact metrics: exact prefill / prefix-hit counts between two snapshots. Deterministic: a cache
    # hit's logits are bitwise a full prefill's.
    exact = dict(metrics_exact=True, deterministic=True)
    cfg = EngineConfig(
        model=str(tiny_model_dir), **QUIET, num_blocks=160, max_model_len=512, block_size=BLOCK, **exact
    )
    with Engine(cfg) as eng:
        yield eng


def _alone(engine, prompt, params: SamplingParams) -> list[int]:
    return engine.generate([prompt], params, use_tqdm=False)[0].token_ids


def test_sample_i_is_the_n1_request_seeded_with_its_key_run_alone(engine):
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=11, n=4, **COMMON)
    out = engine.generate([PROMPT], params, use_tqdm=False)[0]
    assert [s.index for s in out.samples] == [0, 1, 2, 3]
    assert out.samples[0] is out and out.index == 0
    assert [s.seed for s in out.samples] == [sample_key(11, i) for i in range(4)]
    assert all(s.prompt_token_ids == PROMPT and len(s.token_ids) == 10 for s in out.samples)
    for s in out.samples:
        ref = SamplingParams(temperature=1.0, top_p=0.95, seed=s.seed, **COMMON)
        assert_drained(engine)  # each reference computes its prompt from scratch, by itself
        assert _alone(engine, PROMPT, ref) == s.token_ids, s.index
    assert len({tuple(s.token_ids) for s in out.samples}) == 4  # distinct keys, distinct samples
    # Sample i does not depend on n: n = 2 gives the first two of n = 4, and n = 1 gives sample 0.
    two = engine.generate([PROMPT], SamplingParams(temperature=1.0, top_p=0.95, seed=11, n=2, **COMMON))[0]
    assert [s.token_ids for s in two.samples] == [s.token_ids for s in out.samples[:2]]
    one = engine.generate([PROMPT], SamplingParams(temperature=1.0, top_p=0.95, seed=11, **COMMON))[0]
    assert one.samples == (one,) and one.token_ids == out.token_ids
    # Unseeded: each sample reports its key, and that key replays it alone.
    free = engine.generate([PROMPT], SamplingParams(n=3, **COMMON), use_tqdm=False)[0]
    for s in free.samples:
        assert _alone(engine, PROMPT, SamplingParams(seed=s.seed, **COMMON)) == s.token_ids
    # Greedy ignores the keys: every sample is the greedy output.
    greedy = engine.generate([PROMPT], SamplingParams(temperature=0, n=3, **COMMON), use_tqdm=False)[0]
    ref = _alone(engine, PROMPT, SamplingParams(temperature=0, **COMMON))
    assert [s.token_ids for s in greedy.samples] == [ref] * 3
    # A batch of prompts mixing n: one output per prompt, in input order.
    mixed = engine.generate(
        [PROMPT, [5, 6, 7]],
        [SamplingParams(temperature=0, **COMMON), SamplingParams(seed=3, n=2, **COMMON)],
        use_tqdm=False,
    )
    assert [len(o.samples) for o in mixed] == [1, 2] and mixed[0].token_ids == ref
    assert_drained(engine)


def _delta(before: dict[str, float], after: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


@pytest.mark.parametrize("prompt_logprobs", [None, 1])
def test_the_prompt_is_computed_once_for_all_samples(engine, prompt_logprobs):
    """Sample 0 computes the prompt; samples 1..3 start from its two full blocks (prefix hits) and
    compute only the 8-token tail. Scoring prompt logprobs (sample 0 alone scores them, so it hits
    nothing itself) does not stop the others from sharing its blocks."""
    assert_drained(engine)
    prompt = [1000 + i for i in range(40)]
    params = SamplingParams(seed=5, n=4, prompt_logprobs=prompt_logprobs, **COMMON)
    before = engine.metrics()
    out = engine.generate([prompt], params, use_tqdm=False)[0]
    after = engine.metrics()
    shared = 2 * BLOCK
    assert _delta(before, after, "prefill_tokens") == 40 + 3 * (40 - shared)
    assert _delta(before, after, "prefix_hits") == 3
    assert _delta(before, after, "prefix_hit_tokens") == 3 * shared
    assert _delta(before, after, "requests_finished") == 1
    if prompt_logprobs is not None:
        alone = engine.generate([prompt], SamplingParams(prompt_logprobs=1, **COMMON), use_tqdm=False)[0]
        assert alone.prompt_logprobs[0] is None and alone.prompt_logprobs[1] is not None
        assert all(s.prompt_logprobs == alone.prompt_logprobs for s in out.samples)
    assert_drained(engine)


def test_streamed_deltas_carry_their_sample_index_and_samples_finish_on_their_own(engine):
    base = SamplingParams(seed=21, n=3, **COMMON)
    ref = engine.generate([PROMPT], base, use_tqdm=False)[0]
    stop_at = ref.samples[1].token_ids[3]  # sample 1 stops at its fourth token; 0 and 2 go on
    if stop_at in ref.samples[0].token_ids or stop_at in ref.samples[2].token_ids:
        pytest.skip("the stop token also occurs in another sample")
    params = SamplingParams(seed=21, n=3, stop_token_ids=[stop_at], **COMMON)
    handle = engine.submit(PROMPT, params)
    tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}
    finished: list[int] = []
    for d in handle:
        assert not finished or d.index not in finished  # nothing after a sample's final delta
        tokens[d.index] += d.token_ids
        if d.finished:
            finished.append(d.index)
    out = handle.result(timeout=30)
    assert sorted(finished) == [0, 1, 2]
    assert [tokens[i] for i in range(3)] == [s.token_ids for s in out.samples]
    assert out.samples[1].token_ids == ref.samples[1].token_ids[:4]
    assert [s.finish_reason for s in out.samples] == ["length", "stop", "length"]
    assert out.samples[0].token_ids == ref.token_ids and out.samples[2].token_ids == ref.samples[2].token_ids
    assert_drained(engine)


def test_abort_ends_every_sample(engine):
    handle = engine.submit(PROMPT, SamplingParams(n=5, max_tokens=400, ignore_eos=True))
    next(iter(handle))  # running
    engine.abort(handle.request_id)
    out = handle.result(timeout=30)
    assert [s.finish_reason for s in out.samples] == ["abort"] * 5
    assert_drained(engine)


def test_a_failing_sample_fails_its_request_and_the_others_are_aborted(engine):
    ref = engine.generate([PROMPT], SamplingParams(seed=4, n=3, **COMMON), use_tqdm=False)[0]
    poison = ref.samples[2].token_ids[0]

    def proc(output_ids, logits):
        if output_ids and output_ids[0] == poison and len(output_ids) == 2:
            raise ValueError("sample 2 is poisoned")
        return logits

    params = SamplingParams(seed=4, n=3, logits_processors=[proc], **{**COMMON, "max_tokens": 200})
    handle = engine.submit(PROMPT, params)
    with pytest.raises(RequestFailedError, match="poisoned"):
        handle.result(timeout=30)
    with pytest.raises(RequestFailedError):
        list(handle)
    assert_drained(engine)
    assert _alone(engine, PROMPT, SamplingParams(seed=4, **COMMON)) == ref.token_ids  # it goes on


@pytest.mark.slow
def test_samples_are_invariant_across_the_scheduling_grid(tiny_model_dir):
    """Each sample of each request is one output (tokens and logprobs bitwise) at max_num_seqs 1
    (the samples run one after another, later ones from the cached prompt), 4 and 64, whole-prompt
    or 8-token chunks, prefix cache on or off, beside random fillers in shuffled orders."""
    grid = Grid.from_dict(
        {
            "fillers": 3,
            "base": {"stats_interval_s": 0, "num_blocks": 128, "max_model_len": 256, "num_threads": 1},
            "axes": {"max_num_seqs": [1, 4, 64], "chunk_size": [None, 8], "prefix_cache": ["async", "off"]},
            "max_points": 5,
            "prefill_check": False,
        }
    )
    workload = Workload.from_dict(
        {
            "max_tokens": 8,
            "logprobs": 1,
            "sampling": {
                "seeded-n3": {"temperature": 1.0, "seed": 9, "n": 3},
                "penalised-n2": {"temperature": 0.8, "seed": 2, "n": 2, "frequency_penalty": 1.0},
            },
            "prompts": [PROMPT, "The capital of France is"],
        }
    )
    report = run_check(grid, workload, {"model": str(tiny_model_dir), "deterministic": True})
    print(report.format_table())
    assert report.points_run == 5 and len(report.requests) == 4
    assert report.num_differing == 0 and all(r.points == 5 for r in report.requests)


# ------------------------------------------------------------------------------------ grammars
@pytest.mark.parametrize(
    "kind,value,check",
    [
        ("regex", r"[0-9]{3}-[a-z]{3}", "regex"),
        ("choice", ["green", "blue", "red"], "choice"),
        (
            "json",
            {
                "type": "object",
                "properties": {"a": {"enum": [1, 2, 3]}},
                "required": ["a"],
                "additionalProperties": False,
            },
            "json",
        ),
    ],
)
def test_every_sample_obeys_the_grammar(tiny_model_dir, kind, value, check):
    """n = 8 samples at a high temperature under one grammar processor: each sample runs its own
    parser state (a fork), so every sample's text obeys the grammar and ends when it completes; and
    two prompts sharing one SamplingParams do too."""
    import json
    import re

    from minisgl_backend.chat.grammar import GrammarProcessor, guide_grammar

    with Engine(EngineConfig(model=str(tiny_model_dir), **QUIET)) as eng:
        proc = GrammarProcessor(eng.tokenizer, guide_grammar(kind, value))
        params = SamplingParams(n=8, temperature=1.5, seed=7, max_tokens=40, logits_processors=(proc,))
        outs = eng.generate(["Answer:", "Colour:"], params, use_tqdm=False)
        texts = [(s.text, s.finish_reason) for o in outs for s in o.samples]
        assert len(texts) == 16
        for text, reason in texts:
            assert reason == "stop", (text, reason)
            if check == "regex":
                assert re.fullmatch(value, text), text
            elif check == "choice":
                assert text in value, text
            else:
                assert json.loads(text)["a"] in (1, 2, 3), text
        assert_drained(eng)
