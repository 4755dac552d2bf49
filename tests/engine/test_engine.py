"""Engine behaviour on a tiny random-weight model: scheduling paths, streaming, stops, bad input."""

from __future__ import annotations

import threading

import pytest

from minisgl_backend import (
    ConfigError,
    EmptyPromptError,
    Engine,
    EngineConfig,
    InvalidRequestError,
    InvalidSamplingParamsError,
    ModelNotFoundError,
    PromptTooLongError,
    RequestFailedError,
    SamplingParams,
)
from tests.helpers import SMALL_POOL, assert_drained, drained_engine, token_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    with drained_engine(tiny_model_dir, **SMALL_POOL) as eng:
        yield eng


@pytest.fixture(scope="module")
def solo(engine):
    """Reference outputs: each prompt run alone, greedy and seeded."""
    prompts = token_prompts(12)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    greedy = [engine.generate([p], GREEDY, use_tqdm=False)[0].token_ids for p in prompts]
    sampled = [engine.generate([p], seeded, use_tqdm=False)[0].token_ids for p in prompts]
    return prompts, seeded, greedy, sampled


@pytest.mark.parametrize(
    "overrides",
    [
        {"chunk_size": None, "mixed_batches": False},  # serial policy
        {"chunk_size": 5, "mixed_batches": True},
        {"chunk_size": 16, "mixed_batches": False},
        {"num_blocks": 24, "chunk_size": 8},  # a pool this small forces preemption
    ],
    ids=["serial", "chunk5-mixed", "chunk16-unmixed", "preempting"],
)
def test_batched_outputs_equal_solo_outputs_under_any_policy(tiny_model_dir, solo, overrides):
    prompts, seeded, greedy, sampled = solo
    cfg = EngineConfig(
        model=str(tiny_model_dir), num_blocks=256, block_size=4, max_num_batched_tokens=64, max_model_len=96
    ).replace(**overrides)
    with Engine(cfg) as eng:
        outs = eng.generate(
            prompts + prompts, [GREEDY] * len(prompts) + [seeded] * len(prompts), use_tqdm=False
        )
        assert [o.token_ids for o in outs[: len(prompts)]] == greedy
        assert [o.token_ids for o in outs[len(prompts) :]] == sampled
        if "num_blocks" in overrides:
            assert sum(o.num_preemptions for o in outs) > 0, "the small pool should have forced preemption"
        assert_drained(eng)


def test_abort_mid_decode_frees_blocks(engine):
    handle = engine.submit(
        token_prompts(1)[0], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    )
    it = iter(handle)
    next(it)  # at least one token decoded: the request holds KV blocks now
    engine.abort(handle.request_id)
    out = handle.result(timeout=30)
    assert out.finish_reason == "abort" and 1 <= len(out.token_ids) < 100
    assert_drained(engine)


def test_stream_closed_early_aborts(engine):
    stream = engine.stream(
        token_prompts(1)[0], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    )
    next(stream)
    stream.close()
    assert_drained(engine)


def test_stream_deltas_concatenate_to_the_final_text(engine):
    params = SamplingParams(temperature=0.7, seed=5, max_tokens=20, ignore_eos=True)
    deltas = list(engine.stream("Streaming test prompt", params))
    final = engine.generate(["Streaming test prompt"], params, use_tqdm=False)[0]
    assert len(deltas) > 1 and deltas[-1].finished and deltas[-1].finish_reason == "length"
    assert "".join(d.text for d in deltas) == final.text
    assert [t for d in deltas for t in d.token_ids] == final.token_ids


def test_many_concurrent_submitters(engine, solo):
    prompts, _, greedy, _ = solo
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            for i in range(k, len(prompts), 4):
                results[i] = engine.submit(prompts[i], GREEDY).result(timeout=120).token_ids
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert [results[i] for i in range(len(prompts))] == greedy


def test_stop_string_spanning_tokens_is_removed(engine):
    prompt = token_prompts(3)[2]
    free = engine.generate([prompt], GREEDY, use_tqdm=False)[0]
    # A stop string made of the end of token 3's text and the start of token 4's: it spans a boundary.
    t3 = engine.tokenizer.decode(free.token_ids[3:4])
    t4 = engine.tokenizer.decode(free.token_ids[4:5])
    head = engine.tokenizer.decode(free.token_ids[:3])
    stop = t3[-2:] + t4[:2]
    assert len(t3) >= 2 and len(t4) >= 2 and stop not in head + t3[:-2]
    out = engine.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]), use_tqdm=False
    )[0]
    assert out.finish_reason == "stop"
    assert out.text == head + t3[:-2]
    assert stop not in out.text and len(out.token_ids) == 5


def test_stop_token_ids_and_max_tokens_one(engine):
    free = engine.generate(["stop ids"], GREEDY, use_tqdm=False)[0]
    out = engine.generate(
        ["stop ids"],
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[free.token_ids[2]]),
        use_tqdm=False,
    )[0]
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[:3]
    one = engine.generate(["stop ids"], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    assert one.token_ids == free.token_ids[:1] and one.finish_reason == "length"
    assert one.timings.first_token is not None and one.timings.finish >= one.timings.first_token
    # Every token's commit time, in order: the first is first_token, the gaps are the ITLs.
    t = free.timings
    assert len(t.token_times) == len(free.token_ids) and t.token_times[0] == t.first_token
    assert list(t.token_times) == sorted(t.token_times) and t.token_times[-1] <= t.finish
    assert len(t.inter_token_latencies) == len(free.token_ids) - 1
    assert sum(t.inter_token_latencies) == pytest.approx(t.token_times[-1] - t.first_token)


def test_prompt_exactly_at_context_limit(engine):
    limit = engine.max_model_len
    out = engine.generate(
        [[300 + i % 1000 for i in range(limit)]], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False
    )[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"
    near = engine.generate(
        [[300] * (limit - 3)], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), use_tqdm=False
    )[0]
    assert len(near.token_ids) == 4 and near.finish_reason == "length"  # KV never exceeds max_model_len
    with pytest.raises(PromptTooLongError, match=f"{limit + 1} tokens.*{limit}"):
        engine.submit([300] * (limit + 1))


def test_unseeded_requests_report_a_replayable_seed(engine):
    params = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    first = engine.generate(["replay me"], params, use_tqdm=False)[0]
    replay = engine.generate(
        ["replay me"],
        SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=first.seed),
        use_tqdm=False,
    )[0]
    assert replay.token_ids == first.token_ids


def test_logprobs_and_prompt_logprobs(engine):
    prompt = token_prompts(2)[1]
    out = engine.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=4, logprobs=3, prompt_logprobs=2, prompt_logprobs_start=5),
        use_tqdm=False,
    )[0]
    assert [lp.token_id for lp in out.logprobs] == out.token_ids
    assert all(lp.rank == 1 and len(lp.top) == 3 and lp.top[0][0] == lp.token_id for lp in out.logprobs)
    assert out.prompt_logprobs[:5] == [None] * 5
    scored = out.prompt_logprobs[5:]
    assert [lp.token_id for lp in scored] == prompt[5:] and all(lp.logprob <= 0 for lp in scored)
    # Scoring inside chunked prefill gives the same numbers as scoring the whole prompt at once.
    with Engine(engine.config.replace(chunk_size=None, mixed_batches=False)) as whole:
        ref = whole.generate(
            [prompt],
            SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2, prompt_logprobs_start=5),
            use_tqdm=False,
        )[0]
    for a, b in zip(scored, ref.prompt_logprobs[5:]):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4


def test_bad_input_is_rejected_and_the_engine_keeps_serving(engine):
    with pytest.raises(EmptyPromptError):
        engine.submit("")
    with pytest.raises(EmptyPromptError):
        engine.submit([])
    with pytest.raises(InvalidRequestError, match="out of range"):
        engine.submit([10**9])
    with pytest.raises(InvalidSamplingParamsError, match="temperature"):
        engine.submit("x", {"temperature": -1})
    with pytest.raises(InvalidSamplingParamsError, match="unknown sampling parameter"):
        engine.submit("x", {"max_new_tokens": 3})
    with pytest.raises(InvalidSamplingParamsError, match="2 sampling params for 1 prompts"):
        engine.generate(["x"], [GREEDY, GREEDY], use_tqdm=False)
    # A batch with one bad prompt is rejected whole, before anything is queued.
    with pytest.raises(EmptyPromptError):
        engine.generate(["fine", ""], use_tqdm=False)
    handle = engine.submit("x", SamplingParams(logits_processors=[lambda ids, logits: 1 / 0]))
    with pytest.raises(RequestFailedError, match="ZeroDivisionError") as err:
        handle.result(timeout=30)
    assert isinstance(err.value.__cause__, ZeroDivisionError)
    assert engine.generate(["still serving"], GREEDY, use_tqdm=False)[0].finish_reason == "length"
    assert_drained(engine)


def test_bad_config_and_model_paths(tmp_path):
    with pytest.raises(ModelNotFoundError, match="unknown model 'no-such-model'.*alias"):
        Engine(EngineConfig(model="no-such-model"))
    with pytest.raises(ModelNotFoundError):
        Engine(EngineConfig(model=str(tmp_path)))  # a directory without config.json
    with pytest.raises(ConfigError, match="unknown engine config key.*chunksize.*valid keys"):
        EngineConfig.from_dict({"chunksize": 8})
    with pytest.raises(ConfigError, match="dtype"):
        EngineConfig(dtype="float16")
    bad = tmp_path / "bad.yaml"
    bad.write_text("chunk_size: 8\nnot_a_key: 1\n")
    with pytest.raises(ConfigError, match="not_a_key"):
        EngineConfig.from_yaml(bad)


def test_yaml_presets_load_with_overrides():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "configs" / "engine"
    serial = EngineConfig.from_yaml(root / "serial.yaml", block_size=8)
    assert serial.chunk_size is None and not serial.mixed_batches and serial.block_size == 8
    assert EngineConfig.from_yaml(root / "default.yaml") == EngineConfig()
    assert EngineConfig.from_yaml(root / "fast-bf16.yaml").dtype == "bfloat16"


@pytest.mark.parametrize("fair", [True, False])
def test_waiting_requests_of_different_owners_are_admitted_in_turn(tiny_model_dir, fair):
    """One client's eight prompts queued ahead of another's one: under scheduling_policy fair the
    other client's request is admitted second (one slot, so the admission order is the run order),
    not ninth; under fcfs, first come first served."""
    cfg = EngineConfig(
        model=str(tiny_model_dir),
        max_num_seqs=1,
        num_threads=1,
        stats_interval_s=0,
        scheduling_policy="fair" if fair else "fcfs",
    )
    release, entered = threading.Event(), threading.Event()

    def blocker(_ids, logits):
        entered.set()
        release.wait(60)
        return logits

    with Engine(cfg) as eng:
        gate = eng.submit([1, 2, 3], SamplingParams(max_tokens=1, logits_processors=(blocker,)))
        try:
            assert entered.wait(60)  # the one slot is taken: everything below waits
            params = SamplingParams(temperature=0, max_tokens=2)
            many = [eng.submit([10 + i, 11, 12], params, owner="many") for i in range(8)]
            one = eng.submit([50, 51, 52], params, owner="one")
        finally:
            release.set()
        gate.result(60)
        outs = [h.result(60) for h in many]
        ahead = sum(o.timings.scheduled < one.result(60).timings.scheduled for o in outs)
    assert ahead == (1 if fair else 8), ahead


def test_switch_interval_is_held_while_engines_run_and_given_back(tiny_model_dir):
    """switch_interval_ms sets Python's GIL switch interval for as long as an engine asking for it
    runs (the shortest of several), and the process's own value returns when the last one closes;
    an engine that asks for none leaves it alone, and a value <= 0 is a ConfigError."""
    import sys

    base = sys.getswitchinterval()
    cfg = EngineConfig(model=str(tiny_model_dir), **SMALL_POOL)
    with Engine(cfg.replace(switch_interval_ms=2.0)):
        assert sys.getswitchinterval() == pytest.approx(0.002)
        with Engine(cfg.replace(switch_interval_ms=0.5)) as short:
            assert sys.getswitchinterval() == pytest.approx(0.0005)
            with Engine(cfg):
                assert sys.getswitchinterval() == pytest.approx(0.0005)
            assert short.generate(token_prompts(1), SamplingParams(max_tokens=2), use_tqdm=False)
        assert sys.getswitchinterval() == pytest.approx(0.002)
    assert sys.getswitchinterval() == base
    with pytest.raises(ConfigError, match="switch_interval_ms"):
        EngineConfig(switch_interval_ms=0)


def test_a_closed_engine_gives_back_its_model_and_kv_pool(tiny_model_dir):
    """An Engine its caller still holds after close() keeps neither its weights nor its KV pool."""
    import gc
    import weakref

    eng = Engine(EngineConfig(model=str(tiny_model_dir), **SMALL_POOL))
    eng.generate(token_prompts(2), SamplingParams(max_tokens=2), use_tqdm=False)
    held = [weakref.ref(eng._executor.kv.k[0]), weakref.ref(next(eng._executor.model.parameters()))]
    eng.close()
    gc.collect()
    assert [r() is None for r in held] == [True, True]
    assert eng.dead is not None or not eng.is_alive  # closed for good, not just emptied
