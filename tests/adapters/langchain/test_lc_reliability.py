"""Issue 11 through LangChain: a bad per-call or constructor value fails that call alone with a typed
error naming the field, the shared engine keeps serving, and a dead registered engine is replaced."""

from __future__ import annotations

import math
import threading

import langchain_minisgl
import pytest
from langchain_minisgl import ChatMiniSGL, MiniSGL

from minisgl_backend import ConfigError, InvalidSamplingParamsError

ENGINE = {"num_blocks": 64, "block_size": 4, "num_threads": 1, "stats_interval_s": 0}
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def llm(tiny_model_dir, close_drained):
    model = MiniSGL(model=str(tiny_model_dir), temperature=0, max_tokens=8, engine_config=ENGINE)
    yield model
    close_drained(model)


@pytest.fixture(scope="module")
def solo(llm):
    return llm.invoke(PROMPT, temperature=0.8, seed=5)


PER_CALL = [
    ({"seed": 2**64, "temperature": 0.8}, "seed"),
    ({"seed": True}, "seed"),
    ({"seed": -1}, "seed"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"top_p": None}, "top_p"),
    ({"top_p": "0.9"}, "top_p"),
    ({"min_p": None}, "min_p"),
    ({"max_tokens": True}, "max_tokens"),
    ({"top_k": 1.5}, "top_k"),
]


@pytest.mark.parametrize("kwargs, field", PER_CALL, ids=[repr(k) for k, _ in PER_CALL])
def test_bad_per_call_value_fails_that_call_alone(llm, solo, kwargs, field):
    engine = llm.engine
    innocent: list[str] = []
    t = threading.Thread(target=lambda: innocent.append(llm.invoke(PROMPT, temperature=0.8, seed=5)))
    t.start()
    with pytest.raises(InvalidSamplingParamsError, match=field):
        llm.invoke("Hello", **kwargs)
    t.join(60)
    assert innocent == [solo]
    assert llm.engine is engine and engine.is_alive
    assert isinstance(llm.invoke("Next"), str)


def test_bad_per_call_value_through_the_chat_model(tiny_model_dir, llm):
    chat = ChatMiniSGL(model=str(tiny_model_dir), temperature=0, max_tokens=4, engine_config=ENGINE)
    with pytest.raises(InvalidSamplingParamsError, match="seed"):
        chat.invoke("Hi", seed=2**64, temperature=0.5)
    assert chat.engine is llm.engine and chat.engine.is_alive  # the same shared engine, still serving
    assert isinstance(chat.invoke("Hi").content, str)


CONSTRUCTOR = [
    ({"engine_config": {**ENGINE, "overlap": "false"}}, "overlap"),
    ({"engine_config": {**ENGINE, "debug_unsafe_reclaim": "false"}}, "debug_unsafe_reclaim"),
    ({"engine_config": {**ENGINE, "mixed_batches": "no"}}, "mixed_batches"),
    ({"engine_config": {**ENGINE, "block_size": 16.5}}, "block_size"),
    ({"engine_config": {**ENGINE, "num_blocks": 2.5}}, "num_blocks"),
    ({"engine_config": {**ENGINE, "seed": 2**64}}, "seed"),
    ({"engine_config": {**ENGINE, "kv_cache_memory_gb": math.inf}}, "kv_cache_memory_gb"),
    ({"engine_config": {**ENGINE, "max_logprobs": True}}, "max_logprobs"),
    ({"seed": 2**64}, "seed"),
    ({"max_tokens": True}, "max_tokens"),
    ({"temperature": "0.5"}, "temperature"),
]


@pytest.mark.parametrize("kwargs, field", CONSTRUCTOR, ids=[repr(k) for k, _ in CONSTRUCTOR])
def test_bad_constructor_value_is_rejected_naming_the_field(tiny_model_dir, kwargs, field):
    before = langchain_minisgl.running_configs()
    with pytest.raises(ValueError, match=field):  # pydantic's ValidationError wraps ConfigError / ...
        MiniSGL(**{"model": str(tiny_model_dir), "engine_config": ENGINE, **kwargs})
    assert langchain_minisgl.running_configs() == before  # nothing was started


def test_engine_config_errors_are_config_errors():
    from langchain_minisgl._engines import build_config

    with pytest.raises(ConfigError, match="overlap"):
        build_config(None, {"overlap": "false"}, None)


def test_a_dead_registered_engine_is_replaced_not_reused(tiny_model_dir):
    cfg = {
        "model": str(tiny_model_dir),
        "temperature": 0,
        "max_tokens": 4,
        "engine_config": {**ENGINE, "num_blocks": 48},
    }
    llm = MiniSGL(**cfg)
    first = llm.engine
    assert isinstance(llm.invoke("Hello"), str)
    first._executor._fail(RuntimeError("simulated worker failure"))  # a worker thread died
    assert not first.is_alive
    assert isinstance(llm.invoke("Hello"), str)  # served by a fresh engine
    fresh = llm.engine
    assert fresh is not first and fresh.is_alive
    assert MiniSGL(**cfg).engine is fresh  # every model with that config gets the fresh one
    assert first.dead is not None  # the dead one was closed when it was replaced
    llm.close()
