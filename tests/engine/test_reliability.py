"""Issue 11, parts 2 and 3: one request's parameters never kill the engine, and every config or
sampling value is validated up front with a typed error naming the field.

Runtime triggers (they pass validation and fail while the request is sampled or scored) run beside
an innocent request: the bad one fails alone with a typed error, the innocent one gives its solo
output, the engine serves the next request, and every block is FREE after drain(flush_cache=True).
"""

from __future__ import annotations

import gc
import json
import math
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from minisgl_backend import (
    ConfigError,
    Engine,
    EngineConfig,
    InvalidRequestError,
    InvalidSamplingParamsError,
    ModelNotFoundError,
    ReentrantCallError,
    RequestFailedError,
    SamplingParams,
)
from minisgl_backend.executor import sample_stage as stage
from minisgl_backend.executor.tracker import PyInflightTracker, make_tracker, native_available
from minisgl_backend.sampling.sampler import SampleRow, sample
from tests.helpers import QUIET, assert_drained

INNOCENT = [100 + (j * 37) % 3000 for j in range(23)]  # 23 tokens: several chunks and blocks
BAD_PROMPT = [200 + (j * 11) % 3000 for j in range(9)]
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True, logprobs=2)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
CONFIG = dict(num_blocks=64, block_size=4, chunk_size=8, max_num_batched_tokens=32, max_model_len=96, **QUIET)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    with Engine(EngineConfig(model=str(tiny_model_dir), **CONFIG)) as eng:
        yield eng
        _assert_drained(eng)


@pytest.fixture(scope="module")
def solo(engine):
    return engine.generate([INNOCENT], SEEDED, use_tqdm=False)[0]


def _assert_drained(engine: Engine) -> None:
    counts = assert_drained(engine)
    assert counts["inflight"] == 0, counts


def _same_as_solo(out, solo) -> None:
    # Token ids exactly; logprobs to float noise (batching changes reduction order off deterministic mode).
    assert out.token_ids == solo.token_ids
    assert [lp.token_id for lp in out.logprobs] == [lp.token_id for lp in solo.logprobs]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(out.logprobs, solo.logprobs)) < 1e-3


def _serves_next(engine: Engine) -> None:
    out = engine.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 6


# ------------------------------------------------------------------ runtime triggers (part 2)
def _raises(exc: BaseException):
    def proc(_ids, _logits):
        raise exc

    return proc


def _after(n: int, fn):
    """Behave like the identity for n tokens, then like `fn` (a failure mid-decode)."""

    def proc(ids, logits):
        return fn(ids, logits) if len(ids) >= n else logits

    return proc


def _const(value: float):
    return lambda _ids, logits: torch.full_like(logits, value)


def _nan_one(_ids, logits):
    out = logits.clone()
    out[3] = float("nan")
    return out


RUNTIME_TRIGGERS = {
    # name: (sampling params of the bad request, text the error must contain, type of the cause or None)
    "processor raises ValueError": (
        dict(logits_processors=[_raises(ValueError("boom"))]),
        "ValueError",
        ValueError,
    ),
    "processor raises SystemExit": (
        dict(logits_processors=[_raises(SystemExit(3))]),
        "SystemExit",
        SystemExit,
    ),
    "processor raises KeyboardInterrupt": (
        dict(logits_processors=[_raises(KeyboardInterrupt())]),
        "KeyboardInterrupt",
        KeyboardInterrupt,
    ),
    "processor raises mid-decode": (
        dict(logits_processors=[_after(3, _raises(RuntimeError("late")))]),
        "late",
        RuntimeError,
    ),
    "all -inf with top_p": (dict(top_p=0.5, logits_processors=[_const(float("-inf"))]), "all -inf", None),
    "all -inf with top_k": (dict(top_k=5, logits_processors=[_const(float("-inf"))]), "all -inf", None),
    "all -inf greedy": (dict(temperature=0, logits_processors=[_const(float("-inf"))]), "all -inf", None),
    "NaN row with min_p": (dict(min_p=0.1, logits_processors=[_const(float("nan"))]), "NaN", None),
    "one NaN logit": (dict(logits_processors=[_nan_one]), "NaN", None),
    "+inf row": (dict(logits_processors=[_const(float("inf"))]), r"\+inf", None),
    "wrong shape": (dict(logits_processors=[lambda _i, logits: logits[:-1]]), "shape", None),
    "wrong dtype": (dict(logits_processors=[lambda _i, logits: logits.long()]), "dtype", None),
    "returns None": (dict(logits_processors=[lambda _i, _l: None]), "NoneType", None),
    "returns numpy": (dict(logits_processors=[lambda _i, logits: logits.numpy()]), "ndarray", None),
}


@pytest.mark.parametrize("name", list(RUNTIME_TRIGGERS))
def test_runtime_trigger_fails_only_its_request(engine, solo, name):
    params, match, cause = RUNTIME_TRIGGERS[name]
    innocent = engine.submit(INNOCENT, SEEDED)
    bad = engine.submit(
        BAD_PROMPT,
        SamplingParams(**{"temperature": 0.7, "seed": 1, "max_tokens": 8, "ignore_eos": True, **params}),
    )
    with pytest.raises(RequestFailedError, match=match) as err:
        bad.result(timeout=60)
    if cause is not None:
        assert isinstance(err.value.__cause__, cause)
    out = innocent.result(timeout=60)
    _same_as_solo(out, solo)
    assert engine.is_alive
    _serves_next(engine)
    _assert_drained(engine)


def test_stream_of_a_failing_request_raises_and_others_stream_on(engine, solo):
    innocent = engine.submit(INNOCENT, SEEDED)
    deltas = []
    with pytest.raises(RequestFailedError, match="SystemExit"):
        for d in engine.stream(
            BAD_PROMPT, SamplingParams(max_tokens=8, logits_processors=[_after(2, _raises(SystemExit(1)))])
        ):
            deltas.append(d)
    assert len(deltas) == 2  # two tokens streamed before the failure
    assert innocent.result(timeout=60).token_ids == solo.token_ids
    _assert_drained(engine)


def test_prompt_logprob_scoring_error_fails_only_that_request(engine, monkeypatch):
    """A failure while scoring one request's prompt logprobs ends that request alone, even when it
    shares a scoring group (same k) with an innocent request."""
    marker = 4242
    real = stage.token_logprobs

    def flaky(logits, token_ids, num_top):
        if marker in list(token_ids):
            raise OverflowError("scoring exploded")
        return real(logits, token_ids, num_top)

    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    ref = engine.generate([INNOCENT], params, use_tqdm=False)[0]
    monkeypatch.setattr(stage, "token_logprobs", flaky)
    innocent = engine.submit(INNOCENT, params)
    bad = engine.submit(BAD_PROMPT[:4] + [marker] + BAD_PROMPT[4:], params)
    with pytest.raises(RequestFailedError, match="prompt logprobs.*scoring exploded") as err:
        bad.result(timeout=60)
    assert isinstance(err.value.__cause__, OverflowError)
    out = innocent.result(timeout=60)
    assert out.token_ids == ref.token_ids
    assert [lp and lp.token_id for lp in out.prompt_logprobs] == [
        lp and lp.token_id for lp in ref.prompt_logprobs
    ]
    assert out.prompt_logprobs[0] is None and all(lp is not None for lp in out.prompt_logprobs[1:])
    monkeypatch.undo()
    _serves_next(engine)
    _assert_drained(engine)


def test_tiny_temperature_is_greedy(engine):
    """Below GREEDY_EPSILON (1e-5) a temperature is greedy: 1e-320 with top_p < 1 used to draw from
    an empty candidate set and kill the engine."""
    greedy = engine.generate(
        [INNOCENT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )
    tiny = engine.generate(
        [INNOCENT],
        SamplingParams(temperature=1e-320, top_p=0.5, max_tokens=8, ignore_eos=True, seed=3),
        use_tqdm=False,
    )
    assert tiny[0].token_ids == greedy[0].token_ids
    assert SamplingParams(temperature=9.9e-6).greedy and not SamplingParams(temperature=1e-5).greedy


def test_empty_candidate_set_is_a_row_error_not_a_crash():
    rows = [
        SampleRow(SamplingParams(temperature=1.0, top_p=0.5, seed=1), 1, 0, ()),
        SampleRow(SamplingParams(temperature=1.0, seed=1), 1, 0, ()),
    ]
    logits = np.zeros((2, 8), dtype=np.float32)
    logits[0, :] = -np.inf
    errors: dict = {}
    tokens = sample(logits, rows, errors)
    assert (
        list(errors) == [0]
        and isinstance(errors[0], RequestFailedError)
        and "no token to draw" in str(errors[0])
    )
    assert 0 <= tokens[1] < 8
    with pytest.raises(RequestFailedError):
        sample(logits, rows)  # without an errors dict the failure is raised
    # A seed past the 64-bit key (validation rejects it; the copy worker must survive it anyway).
    errors = {}
    sample(np.zeros((1, 8), dtype=np.float32), [SampleRow(SamplingParams(), 2**64, 0, ())], errors)
    assert isinstance(errors[0], RequestFailedError) and isinstance(errors[0].__cause__, OverflowError)


# ------------------------------------------------------------------ up-front validation (part 3)
SAMPLING_TRIGGERS = [
    # (kwargs, field named in the error)
    ({"seed": 2**64}, "seed"),
    ({"seed": 2**70, "temperature": 0.5}, "seed"),
    ({"seed": True}, "seed"),
    ({"seed": 1.0}, "seed"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": 2.0}, "max_tokens"),
    ({"logprobs": True}, "logprobs"),
    ({"top_k": True}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"temperature": "0.5"}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"temperature": None}, "temperature"),
    ({"top_p": "0.9"}, "top_p"),
    ({"top_p": None}, "top_p"),
    ({"top_p": math.nan}, "top_p"),
    ({"min_p": None}, "min_p"),
    ({"min_p": "0.1"}, "min_p"),
    ({"stop_token_ids": [1.7]}, "stop_token_ids"),
    ({"stop_token_ids": "a"}, "stop_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop": [3]}, "stop"),
    ({"stop": ["\ud800"]}, "stop"),
    ({"ignore_eos": "false"}, "ignore_eos"),
    ({"skip_special_tokens": 1}, "skip_special_tokens"),
    ({"prompt_logprobs_start": 0}, "prompt_logprobs_start"),
    ({"logits_processors": lambda ids, logits: logits}, "logits_processors"),
]


@pytest.mark.parametrize("kwargs, field", SAMPLING_TRIGGERS, ids=[repr(k) for k, _ in SAMPLING_TRIGGERS])
def test_bad_sampling_params_are_rejected_naming_the_field(engine, solo, kwargs, field):
    innocent = engine.submit(INNOCENT, SEEDED)
    with pytest.raises(InvalidSamplingParamsError, match=field):
        engine.submit(BAD_PROMPT, kwargs)  # as a dict: the same checks as SamplingParams(**kwargs)
    with pytest.raises(InvalidSamplingParamsError, match=field):
        SamplingParams(**kwargs)
    assert innocent.result(timeout=60).token_ids == solo.token_ids


@pytest.mark.parametrize("field, value", [("logprobs", 21), ("prompt_logprobs", 100000)])
def test_logprobs_are_capped_by_max_logprobs(engine, field, value):
    with pytest.raises(InvalidSamplingParamsError, match=f"{field}.*max_logprobs"):
        engine.submit(BAD_PROMPT, {field: value})
    assert (
        engine.generate([BAD_PROMPT], {field: 20, "max_tokens": 1}, use_tqdm=False)[0].finish_reason
        == "length"
    )


@pytest.mark.parametrize(
    "prompt, match",
    [
        (b"hello", "bytes"),
        (bytearray(b"hi"), "bytearray"),
        ("caf\udce9", "surrogate"),
        ([1, True, 3], "int token ids"),
        ([1, 2.0], "int token ids"),
        ("\ud800", "surrogate"),
    ],
)
def test_bad_prompts_are_invalid_requests(engine, prompt, match):
    with pytest.raises(InvalidRequestError, match=match):
        engine.submit(prompt, GREEDY)
    with pytest.raises(InvalidRequestError, match=match):
        engine.generate(prompt, GREEDY, use_tqdm=False)
    _serves_next(engine)


CONFIG_TRIGGERS = [
    ({"debug_unsafe_reclaim": "false"}, "debug_unsafe_reclaim"),
    ({"overlap": "false"}, "overlap"),
    ({"mixed_batches": "false"}, "mixed_batches"),
    ({"metrics_exact": "false"}, "metrics_exact"),
    ({"trace": "false"}, "trace"),
    ({"deterministic": "false"}, "deterministic"),
    ({"overlap": 1}, "overlap"),
    ({"block_size": 16.5}, "block_size"),
    ({"block_size": True}, "block_size"),
    ({"num_blocks": 2.5}, "num_blocks"),
    ({"num_blocks": "8"}, "num_blocks"),
    ({"kv_cache_memory_gb": math.nan}, "kv_cache_memory_gb"),
    ({"kv_cache_memory_gb": math.inf}, "kv_cache_memory_gb"),
    ({"kv_cache_memory_gb": 1e9}, "kv_cache_memory_gb"),
    ({"kv_cache_memory_gb": "1"}, "kv_cache_memory_gb"),
    ({"seed": 2**64}, "seed"),
    ({"seed": -1}, "seed"),
    ({"seed": True}, "seed"),
    ({"max_logprobs": -1}, "max_logprobs"),
    ({"max_logprobs": True}, "max_logprobs"),
    ({"max_num_seqs": True}, "max_num_seqs"),
    ({"max_inflight": 0}, "max_inflight"),
    ({"chunk_size": 8.0}, "chunk_size"),
    ({"stats_interval_s": math.nan}, "stats_interval_s"),
    ({"debug_delay_ms": "5"}, "debug_delay_ms"),
    ({"num_threads": 0}, "num_threads"),
    ({"max_model_len": 1.5}, "max_model_len"),
    ({"dtype": 32}, "dtype"),
    ({"model": 5}, "model"),
    ({"device": None}, "device"),
]


@pytest.mark.parametrize("overrides, field", CONFIG_TRIGGERS, ids=[repr(o) for o, _ in CONFIG_TRIGGERS])
def test_bad_config_values_are_config_errors_naming_the_field(tmp_path, overrides, field):
    with pytest.raises(ConfigError, match=field):
        EngineConfig(**overrides)
    with pytest.raises(ConfigError, match=field):
        EngineConfig.from_dict(overrides)
    with pytest.raises(ConfigError, match=field):
        EngineConfig().replace(**overrides)
    if all(
        isinstance(v, (str, bool, int, float)) and (not isinstance(v, float) or math.isfinite(v))
        for v in overrides.values()
    ):
        preset = tmp_path / "p.yaml"
        preset.write_text(json.dumps(overrides))  # JSON is YAML: the same value types
        with pytest.raises(ConfigError, match=field):
            EngineConfig.from_yaml(preset)


def test_config_error_names_the_accepted_range():
    with pytest.raises(
        ConfigError, match=r"seed must be an int in \[0, 2\*\*64\) or None, got 18446744073709551616"
    ):
        EngineConfig(seed=2**64)
    with pytest.raises(ConfigError, match=r"overlap must be true or false \(a bool\), got 'false'"):
        EngineConfig(overlap="false")
    with pytest.raises(
        InvalidSamplingParamsError, match=r"top_p must be a finite number in \(0, 1\], got '0.9'"
    ):
        SamplingParams(top_p="0.9")


def test_good_values_are_normalised():
    cfg = EngineConfig(num_blocks=np.int64(8), kv_cache_memory_gb=2, model=Path("x"), seed=2**64 - 1)
    assert type(cfg.num_blocks) is int and type(cfg.kv_cache_memory_gb) is float and cfg.model == "x"
    sp = SamplingParams(temperature=1, top_k=-1, seed=2**64 - 1, stop="\n", stop_token_ids=[np.int32(5)])
    assert sp.temperature == 1.0 and sp.top_k == 0 and sp.stop == ("\n",) and sp.stop_token_ids == (5,)


@pytest.mark.parametrize(
    "item, field",
    [
        ("overlap=maybe", "overlap"),
        ("block_size=16.5", "block_size"),
        ("seed=18446744073709551616", "seed"),
        ("debug_unsafe_reclaim='false'", "debug_unsafe_reclaim"),
    ],
)
def test_cli_set_goes_through_the_same_checks(capsys, item, field):
    from minisgl_backend.cli import main

    assert main(["generate", "--set", item, "Hi"]) == 2
    assert field in capsys.readouterr().err


def test_seed_at_the_top_of_the_range_samples(engine):
    out = engine.generate(
        [BAD_PROMPT], SamplingParams(temperature=1.0, seed=2**64 - 1, max_tokens=4, top_p=0.9), use_tqdm=False
    )[0]
    assert out.seed == 2**64 - 1 and len(out.token_ids) >= 1


# ------------------------------------------------------------------ model loading errors
def _copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _safetensors(d: Path) -> Path:
    return sorted(d.glob("*.safetensors"))[0]


def test_corrupt_safetensors_is_a_model_error(tiny_model_dir, tmp_path):
    d = _copy_model(tiny_model_dir, tmp_path / "corrupt")
    _safetensors(d).write_bytes(b"\x00\x01 not a safetensors file" * 10)
    with pytest.raises(ModelNotFoundError, match="corrupt or truncated safetensors"):
        Engine(EngineConfig(model=str(d), num_blocks=8, num_threads=1))


def test_truncated_safetensors_is_a_model_error(tiny_model_dir, tmp_path):
    d = _copy_model(tiny_model_dir, tmp_path / "truncated")
    f = _safetensors(d)
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(ModelNotFoundError, match="safetensors"):
        Engine(EngineConfig(model=str(d), num_blocks=8, num_threads=1))


def test_bad_config_json_is_a_config_error(tiny_model_dir, tmp_path):
    d = _copy_model(tiny_model_dir, tmp_path / "badjson")
    (d / "config.json").write_text("{ this is not json")
    with pytest.raises(ConfigError, match="config.json"):
        Engine(EngineConfig(model=str(d), num_blocks=8, num_threads=1))


@pytest.mark.parametrize("model_type", ["gpt2", "no_such_architecture"])
def test_unsupported_model_type_is_a_config_error(tiny_model_dir, tmp_path, model_type):
    d = _copy_model(tiny_model_dir, tmp_path / model_type)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = model_type
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="model_type|config.json"):
        Engine(EngineConfig(model=str(d), num_blocks=8, num_threads=1))


def test_truncated_gguf_is_a_model_error(tmp_path, monkeypatch):
    monkeypatch.setenv("MINISGL_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "broken.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 13)
    with pytest.raises(ModelNotFoundError, match="GGUF"):
        Engine(EngineConfig(model=str(gguf), num_blocks=8, num_threads=1))


# ------------------------------------------------------------------ Also: re-entrancy, finaliser, tracker
def test_processor_calling_back_into_the_engine_fails_instead_of_deadlocking(engine, solo):
    innocent = engine.submit(INNOCENT, SEEDED)
    long_greedy = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    calls = {
        "result": lambda target: target.result(),
        "drain": lambda _: engine.drain(),
        "check_invariants": lambda _: engine.check_invariants(),
        "generate": lambda _: engine.generate([[1, 2]], GREEDY, use_tqdm=False),
        "stream": lambda _: list(engine.stream([1, 2], GREEDY)),
        "iterate a handle": lambda target: list(target),
        "close": lambda _: engine.close(),
    }
    for name, call in calls.items():
        target = engine.submit(INNOCENT, long_greedy)  # still running when the processor calls

        def proc(_ids, logits, call=call, target=target):
            call(target)
            return logits

        h = engine.submit(BAD_PROMPT, SamplingParams(max_tokens=4, logits_processors=[proc]))
        with pytest.raises(RequestFailedError, match="ReentrantCallError") as err:
            h.result(timeout=30)
        assert isinstance(err.value.__cause__, ReentrantCallError), name
        assert "engine's own thread 'minisgl-copy'" in str(err.value.__cause__)
        engine.abort(target.request_id)
        assert target.result(timeout=30).finish_reason in ("abort", "length")
    _same_as_solo(innocent.result(timeout=60), solo)
    assert engine.is_alive
    _assert_drained(engine)


def test_iterating_a_finished_handle_again_returns_at_once(engine):
    h = engine.submit([1, 2, 3], GREEDY)
    assert sum(len(d.token_ids) for d in h) == 6
    assert list(h) == []  # used to block forever


def test_done_callback_calling_generate_raises_instead_of_deadlocking(engine):
    seen: list[BaseException] = []
    got = threading.Event()

    def callback(_h):
        try:
            engine.generate([[1, 2]], GREEDY, use_tqdm=False)
        except BaseException as e:  # noqa: BLE001
            seen.append(e)
        got.set()

    engine.submit([1, 2, 3], GREEDY).add_done_callback(callback)
    assert got.wait(30)
    assert isinstance(seen[0], ReentrantCallError) and "minisgl-scheduler" in str(seen[0])
    _serves_next(engine)


def _engine_threads() -> int:
    return sum(t.name.startswith("minisgl-") and t.name != "minisgl-log-flush" for t in threading.enumerate())


def _wait_threads(n: int, timeout: float = 20.0) -> int:
    deadline = time.monotonic() + timeout
    while _engine_threads() != n and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    return _engine_threads()


def _settled_threads(timeout: float = 20.0) -> int:
    """The engine thread count once it stopped changing for half a second: the threads of an
    engine that an earlier test closed may still be on their way out on a loaded machine."""
    deadline = time.monotonic() + timeout
    last, since = _engine_threads(), time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - since < 0.5:
        gc.collect()
        time.sleep(0.05)
        if (n := _engine_threads()) != last:
            last, since = n, time.monotonic()
    return last


def test_dropped_engine_is_closed_by_its_finaliser(tiny_model_dir):
    base = _settled_threads()
    eng = Engine(EngineConfig(model=str(tiny_model_dir), num_blocks=32, block_size=4, num_threads=1))
    assert eng.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].finish_reason == "length"
    assert _engine_threads() == base + 4  # scheduler, compute, copy, metrics
    del eng
    gc.collect()
    assert _wait_threads(base) == base


def test_engine_dropped_with_work_in_flight_finishes_it_then_closes(tiny_model_dir):
    base = _settled_threads()
    handle = Engine(
        EngineConfig(model=str(tiny_model_dir), num_blocks=32, block_size=4, num_threads=1)
    ).submit([1, 2, 3], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    gc.collect()
    assert len(handle.result(timeout=60).token_ids) == 20  # the busy engine stayed alive for it
    assert _wait_threads(base) == base


def test_closed_engine_reports_dead(tiny_model_dir):
    eng = Engine(EngineConfig(model=str(tiny_model_dir), num_blocks=16, block_size=4, num_threads=1))
    assert eng.is_alive and eng.dead is None
    eng.close()
    eng.close()  # idempotent
    assert not eng.is_alive and "closed" in str(eng.dead)


@pytest.mark.parametrize("impl", ["python", "native"])
def test_tracker_complete_without_inflight_is_an_error(impl):
    if impl == "native" and not native_available():
        pytest.skip("native tracker not built")
    t = make_tracker(impl, 2) if impl == "native" else PyInflightTracker(2)
    with pytest.raises(RuntimeError, match="no iteration is in flight"):
        t.complete(1)
    assert t.inflight == 0 and t.drain() == []
    t.begin()
    t.complete(7)
    with pytest.raises(RuntimeError, match="no iteration is in flight"):
        t.complete(8)
    assert t.inflight == 0 and t.drain() == [7]
    t.begin()
    t.begin()  # backpressure still holds at max_inflight
    with pytest.raises(RuntimeError, match="max_inflight"):
        t.begin()


# ------------------------------------------------------------------ the same classes through lm-eval
GEN_KWARGS = [
    ({"seed": 2**64, "do_sample": True, "temperature": 0.5}, "seed"),
    ({"seed": True, "do_sample": True, "temperature": 0.5}, "seed"),
    ({"seed": 1.7, "do_sample": True, "temperature": 0.5}, "seed"),
    ({"do_sample": True, "temperature": "hot"}, "temperature"),
    ({"do_sample": True, "temperature": math.nan}, "temperature"),
    ({"do_sample": True, "temperature": 0.5, "top_k": 1.5}, "top_k"),
    ({"do_sample": True, "temperature": 0.5, "top_p": "0.9"}, "top_p"),
    ({"max_gen_toks": True}, "max_tokens"),
    ({"max_gen_toks": 2.5}, "max_tokens"),
]


@pytest.mark.parametrize("gen_kwargs, field", GEN_KWARGS, ids=[repr(k) for k, _ in GEN_KWARGS])
def test_lm_eval_bad_gen_kwargs_fail_the_call_not_the_engine(engine, solo, gen_kwargs, field):
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval_minisgl.model import MiniSGLLM

    lm = MiniSGLLM(engine=engine, max_length=96, max_gen_toks=4)
    innocent = engine.submit(INNOCENT, SEEDED)
    with pytest.raises(InvalidSamplingParamsError, match=field):
        lm.generate_until([Instance("generate_until", {}, ("Hello", {"until": ["\n"], **gen_kwargs}), 0)])
    _same_as_solo(innocent.result(timeout=60), solo)
    good = lm.generate_until(
        [
            Instance(
                "generate_until",
                {},
                ("Hello", {"until": ["\n\n"], "do_sample": True, "temperature": 0.5, "seed": 2**64 - 1}),
                0,
            )
        ]
    )
    assert isinstance(good[0], str) and engine.is_alive
    _assert_drained(engine)


MODEL_ARGS = [
    ("overlap=maybe", "overlap"),
    ("debug_unsafe_reclaim=nope", "debug_unsafe_reclaim"),
    ("block_size=16.5", "block_size"),
    ("num_blocks=2.5", "num_blocks"),
    ("seed=18446744073709551616", "seed"),
    ("kv_cache_memory_gb=nan", "kv_cache_memory_gb"),
    ("max_logprobs=True", "max_logprobs"),
    ("max_num_seqs=True", "max_num_seqs"),
]


@pytest.mark.parametrize("arg, field", MODEL_ARGS)
def test_lm_eval_bad_model_args_are_config_errors(tiny_model_dir, arg, field):
    pytest.importorskip("lm_eval")
    from lm_eval_minisgl.model import MiniSGLLM

    before = _engine_threads()
    with pytest.raises(ConfigError, match=field):  # the stock CLI's parsing of --model_args
        MiniSGLLM.create_from_arg_string(f"pretrained={tiny_model_dir},{arg}")
    assert _engine_threads() == before  # rejected before any engine started
