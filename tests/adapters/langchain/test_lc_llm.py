"""MiniSGL (BaseLLM): there is no standard LangChain suite for plain LLMs, so these are its contract."""

from __future__ import annotations

import asyncio
import threading
import time

import langchain_minisgl
import pytest
from langchain_core.callbacks import AsyncCallbackHandler, BaseCallbackHandler
from langchain_minisgl import MiniSGL

from minisgl_backend import EngineDeadError

REAL = {"model": "smollm2-135m-instruct", "engine_config": {"dtype": "bfloat16"}}


@pytest.fixture(scope="module")
def tiny(tiny_model_dir, close_drained):
    """Greedy MiniSGL on the tiny random model: fast, context-dependent, rarely hits EOS."""
    llm = MiniSGL(model=str(tiny_model_dir), temperature=0, max_tokens=12, engine_config={"num_blocks": 256})
    yield llm
    close_drained(llm)


class Tokens(BaseCallbackHandler):
    def __init__(self) -> None:
        self.tokens: list[str] = []

    def on_llm_new_token(self, token: str, **kwargs) -> None:
        self.tokens.append(token)


class AsyncTokens(AsyncCallbackHandler):
    def __init__(self) -> None:
        self.tokens: list[str] = []

    async def on_llm_new_token(self, token: str, **kwargs) -> None:
        self.tokens.append(token)


def test_invoke_reports_usage_model_and_finish_reason(tiny):
    res = tiny.generate(["Hello there, general"])
    gen = res.generations[0][0]
    n_prompt = len(tiny.engine.tokenizer.encode("Hello there, general"))
    usage = res.llm_output["token_usage"]
    assert usage["prompt_tokens"] == n_prompt
    assert 1 <= usage["completion_tokens"] <= 12
    assert usage["total_tokens"] == n_prompt + usage["completion_tokens"]
    assert res.llm_output["model_name"] == tiny.model_name
    assert gen.generation_info["finish_reason"] in ("stop", "length")
    assert tiny.invoke("Hello there, general") == gen.text  # greedy, same batch shape: same text


def test_batch_puts_every_prompt_into_the_engine_before_any_finishes(tiny, monkeypatch):
    eng = tiny.engine
    submitted: list[float] = []
    finished: list[float] = []
    real_submit = eng.submit

    def spy(*args, **kwargs):
        handle = real_submit(*args, **kwargs)
        submitted.append(time.perf_counter())
        handle.add_done_callback(lambda _h: finished.append(time.perf_counter()))
        return handle

    monkeypatch.setattr(eng, "submit", spy)
    prompts = [f"Story number {i}:" for i in range(6)]
    # Long enough that a loaded machine's stalls between two submits (the caller's thread tokenises
    # each prompt while the engine's threads hold the interpreter) cannot let the first one finish.
    outs = tiny.batch(prompts, max_tokens=300, ignore_eos=True)
    assert len(outs) == 6 and all(isinstance(o, str) for o in outs)
    assert len(submitted) == 6
    assert max(submitted) < min(finished), "batch() waited for a request before submitting the next"


def test_stream_yields_tokens_fires_callbacks_and_matches_invoke(tiny):
    handler = Tokens()
    chunks = list(tiny.stream("Once upon a time", config={"callbacks": [handler]}))
    assert len(chunks) > 1
    assert handler.tokens and "".join(handler.tokens) == "".join(chunks)
    assert "".join(chunks) == tiny.invoke("Once upon a time")


async def test_async_variants_do_not_block_the_event_loop(tiny):
    ticks = 0
    done = asyncio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            await asyncio.sleep(0.005)

    t = asyncio.create_task(ticker())
    handler = AsyncTokens()
    # Long generations: a loop that is not blocked ticks hundreds of times over them even when a
    # loaded machine delays it, and one that is blocked ticks hardly at all.
    long = {"max_tokens": 200, "ignore_eos": True}
    text = await tiny.ainvoke("Once upon a time", **long)
    outs = await tiny.abatch(["Once upon a time", "In a galaxy far"], **long)
    chunks = [c async for c in tiny.astream("Once upon a time", config={"callbacks": [handler]}, **long)]
    done.set()
    await t
    assert text == outs[0] == "".join(chunks)
    assert len(chunks) > 1 and "".join(handler.tokens) == text
    assert ticks >= 20, "the event loop was blocked while the engine worked"


def test_stop_sequences_invoke_and_stream():
    llm = MiniSGL(**REAL, temperature=0, max_tokens=24)
    prompt = "Count from one to ten: one, two, three,"
    free = llm.invoke(prompt)
    assert "," in free  # without a stop the model keeps counting with commas
    stopped = llm.invoke(prompt, stop=[","])
    streamed = "".join(llm.stream(prompt, stop=[","]))
    assert "," not in stopped and stopped == free.split(",")[0]
    assert streamed == stopped
    # get_num_tokens uses the engine's tokenizer (offline), not LangChain's GPT-2 default.
    assert llm.get_num_tokens(prompt) == len(llm.engine.tokenizer.encode(prompt, add_special_tokens=False))


def test_models_with_the_same_config_share_one_engine(tiny, tiny_model_dir):
    twin = MiniSGL(model=str(tiny_model_dir), temperature=0.5, engine_config={"num_blocks": 256})
    other = MiniSGL(model=str(tiny_model_dir), engine_config={"num_blocks": 128})
    assert twin.engine is tiny.engine  # sampling settings do not split engines
    assert other.engine is not tiny.engine
    assert langchain_minisgl.close_engine(other._config)
    assert other._config not in langchain_minisgl.running_configs()


def test_unknown_fields_and_options_are_rejected(tiny_model_dir):
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['temprature'\]"):
        MiniSGL(model=str(tiny_model_dir), temprature=0)
    with pytest.raises(ValueError, match="unknown engine config key.*chunksize"):  # ConfigError, via pydantic
        MiniSGL(model=str(tiny_model_dir), engine_config={"chunksize": 8})
    with pytest.raises(ValueError, match="top_p"):
        MiniSGL(model=str(tiny_model_dir), top_p=0)


def test_unknown_call_option_is_rejected(tiny):
    with pytest.raises(TypeError, match="max_new_tokens"):
        tiny.invoke("Hi", max_new_tokens=3)


def test_penalties_and_logit_bias_are_fields_and_call_options(tiny, tiny_model_dir):
    params = tiny.sampling_params(None, {"frequency_penalty": 1.5, "logit_bias": {7: -100}})
    assert (params.frequency_penalty, params.presence_penalty, params.repetition_penalty) == (1.5, 0.0, 1.0)
    assert params.logit_bias == ((7, -100.0),) and params.greedy
    forced = tiny.engine.tokenizer.decode([4242] * 3)
    assert tiny.invoke("Hi", max_tokens=3, logit_bias={4242: 100}) == forced
    biased = MiniSGL(
        model=str(tiny_model_dir), temperature=0, max_tokens=3, logit_bias={4242: 100}, repetition_penalty=1.2
    )
    assert biased.sampling_params(None, {}).repetition_penalty == 1.2
    assert biased.invoke("Hi") == forced
    with pytest.raises(ValueError, match="presence_penalty"):
        MiniSGL(model=str(tiny_model_dir), presence_penalty=3)
    with pytest.raises(ValueError, match="logit_bias keys must be token ids"):
        MiniSGL(model=str(tiny_model_dir), logit_bias={"5": 1.0})


def test_dead_engine_raises_in_the_caller_and_retries_on_a_fresh_one(tiny_model_dir):
    cfg = {
        "model": str(tiny_model_dir),
        "temperature": 0,
        "max_tokens": 4,
        "engine_config": {"num_blocks": 64},
    }
    llm = MiniSGL(**cfg)
    dead = llm.engine
    dead.close()  # the engine stops under the model's feet
    # A dead registered engine is replaced, never reused: the next call starts a fresh one.
    assert isinstance(llm.invoke("Hello"), str)
    assert llm.engine is not dead and llm.engine.is_alive
    # A request in flight when its engine dies fails with EngineDeadError (retried when asked).
    retrying = MiniSGL(**cfg, max_retries=1)
    assert isinstance(retrying.invoke("Hello"), str)
    assert retrying.engine is not dead


def test_engine_closing_mid_request_fails_the_waiting_caller(tiny_model_dir):
    llm = MiniSGL(
        model=str(tiny_model_dir), temperature=0, max_tokens=2000, engine_config={"num_blocks": 200}
    )
    errors: list[BaseException] = []

    def call() -> None:
        try:
            llm.invoke("Hello")
        except BaseException as e:  # noqa: BLE001 - recorded for the assertion
            errors.append(e)

    th = threading.Thread(target=call)
    th.start()
    time.sleep(0.5)
    langchain_minisgl.close_engine(llm._config)
    th.join(timeout=30)
    assert not th.is_alive(), "the caller hung after its engine closed"
    assert len(errors) == 1 and isinstance(errors[0], EngineDeadError)


def _spy_aborts(eng, monkeypatch) -> list[str]:
    aborted: list[str] = []
    real = eng.abort

    def spy(request_id: str) -> None:
        aborted.append(request_id)
        real(request_id)

    monkeypatch.setattr(eng, "abort", spy)
    return aborted


def _assert_aborted_and_freed(eng, aborted: list[str]) -> None:
    assert len(aborted) == 1
    counts = eng.drain(timeout=60, flush_cache=True)
    assert counts["running"] == counts["waiting"] == 0
    assert counts["FREE"] == eng.num_blocks


async def test_cancelling_an_async_stream_aborts_the_request(tiny, monkeypatch):
    eng = tiny.engine
    aborted = _spy_aborts(eng, monkeypatch)
    seen = 0

    async def consume() -> None:
        nonlocal seen
        async for _ in tiny.astream("Tell me everything", max_tokens=900):
            seen += 1

    task = asyncio.create_task(consume())
    while seen < 2:
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.to_thread(_assert_aborted_and_freed, eng, aborted)


def test_breaking_out_of_a_sync_stream_aborts_the_request(tiny, monkeypatch):
    eng = tiny.engine
    aborted = _spy_aborts(eng, monkeypatch)
    stream = tiny.stream("Tell me everything", max_tokens=900)
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()  # what leaving a `for` over a generator does once it is collected
    _assert_aborted_and_freed(eng, aborted)


def test_timeout_aborts_the_request(tiny, tiny_model_dir, monkeypatch):
    impatient = MiniSGL(
        model=str(tiny_model_dir), max_tokens=900, timeout=0.05, engine_config={"num_blocks": 256}
    )
    assert impatient.engine is tiny.engine
    aborted = _spy_aborts(tiny.engine, monkeypatch)
    with pytest.raises(TimeoutError):
        impatient.invoke("Tell me everything")
    _assert_aborted_and_freed(tiny.engine, aborted)


def test_per_call_model_override_uses_that_models_engine(tiny, tiny_model_dir):
    llm = MiniSGL(**REAL, temperature=0, max_tokens=4)
    res = llm.generate(["Hello"], model=str(tiny_model_dir))
    assert res.llm_output["model_name"] == str(tiny_model_dir)
    assert llm._config.replace(model=str(tiny_model_dir)) in langchain_minisgl.running_configs()


def test_n_gives_n_generations_per_prompt_each_reproducible(tiny):
    res = tiny.generate(["Hello", "Once upon"], n=3, temperature=1.0, seed=4, max_tokens=6)
    assert [len(g) for g in res.generations] == [3, 3]
    texts = [g.text for g in res.generations[0]]
    assert len(set(texts)) == 3  # distinct sampling keys
    # Generation i replays alone with the seed value it reports; the first is the n = 1 answer.
    for g in res.generations[0]:
        assert tiny.invoke("Hello", temperature=1.0, seed=g.generation_info["seed"], max_tokens=6) == g.text
    assert tiny.invoke("Hello", temperature=1.0, seed=4, max_tokens=6) == texts[0]
    assert all(g.generation_info["finish_reason"] == "length" for gs in res.generations for g in gs)
    assert res.llm_output["token_usage"]["completion_tokens"] == 2 * 3 * 6  # every sample counts
    with pytest.raises(ValueError, match="n must be 1 when streaming"):
        list(tiny.stream("Hello", n=2))
    with pytest.raises(ValueError, match="n must be an int >= 1"):
        tiny.invoke("Hello", n=0)
