"""Fields, engine access and thread→asyncio bridging shared by MiniSGL and ChatMiniSGL."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, Field, PrivateAttr, create_model, model_validator

from langchain_minisgl._engines import build_config, evict_engine, get_engine
from minisgl_backend import (
    Engine,
    EngineConfig,
    EngineDeadError,
    InvalidSamplingParamsError,
    RequestHandle,
    RequestOutput,
    SamplingParams,
    StreamDelta,
)
from minisgl_backend.aio import call_soon, result_future
from minisgl_backend.types import pydantic_fields, surface_fields

# LangChain's own defaults where they differ from the engine's: a chat model's usual temperature and
# a budget for a whole answer rather than a completion's few tokens.
_DEFAULTS = {"temperature": 0.7, "max_tokens": 256}
# `stop` is declared by hand: the model's stops and a call's `stop` argument are merged.
_OWN = ("stop",)


def reject_unknown_fields(cls: type[BaseModel], values: Any) -> Any:
    """Pydantic drops unknown constructor arguments silently; a typo must fail loudly instead."""
    if isinstance(values, dict):
        known = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"{cls.__name__} got unknown field(s) {unknown}. Engine options go in engine_config={{...}}; "
                f"valid fields: {', '.join(sorted(cls.model_fields))}"
            )
    return values


class _ParamsBase(BaseModel):
    """What both LangChain classes are configured with; the sampling fields are added from
    SamplingParams's by `params_model`."""

    # The SamplingParams class built and the fields taken from it (per-call options too).
    params_cls: ClassVar[type[SamplingParams]] = SamplingParams
    sampling_names: ClassVar[tuple[str, ...]] = ()

    model: str | None = None
    """Model reference (alias such as 'smollm2-135m-instruct', HF directory or .gguf path).
    None: the preset's model, else the embedded default."""
    engine_config: dict[str, Any] = Field(default_factory=dict)
    """EngineConfig fields (dtype, chunk_size, num_blocks, ...); passed through to the engine unchanged."""
    engine_preset: str | None = None
    """Engine preset: YAML path or name under configs/engine/; engine_config and model override its keys."""
    stop: list[str] | None = None
    """Stop strings of every call (a call's own `stop` adds to them)."""
    timeout: float | None = None
    """Seconds to wait for one request; on expiry it is aborted in the engine and TimeoutError raised."""
    max_retries: int = 0
    """Times a request is retried on a fresh engine after its engine died (EngineDeadError)."""

    _config: EngineConfig = PrivateAttr()

    @model_validator(mode="before")
    @classmethod
    def _reject_unknown(cls, values: Any) -> Any:
        values = reject_unknown_fields(cls, values)
        if isinstance(values, dict):
            # The engine's checks on the values as given, before pydantic coerces them ("0.5" -> 0.5,
            # True -> 1): the same rules as per-call kwargs and the Python API.
            cls.params_cls(**{k: values[k] for k in cls.sampling_names if k in values})
        return values

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model": self.model_name,
            "engine_config": self._config,
            **self._sampling_dict({}),
            "stop": self.stop,
        }

    @model_validator(mode="after")
    def _build_engine_config(self) -> _ParamsBase:
        # Validated at construction (ConfigError on a bad key/value); the engine itself starts lazily.
        self._config = build_config(self.model, self.engine_config, self.engine_preset)
        self.params_cls(**self._sampling_dict({}))  # fail now on out-of-range sampling values
        return self

    @property
    def model_name(self) -> str:
        return self._config.model if self.model is None else self.model

    def _config_for(self, kwargs: dict[str, Any]) -> EngineConfig:
        override = kwargs.get("model")
        return self._config if override is None else self._config.replace(model=override)

    def engine_for(self, kwargs: dict[str, Any] | None = None) -> Engine:
        """The shared engine serving this model (a per-call `model=` kwarg selects another one)."""
        return get_engine(self._config_for(kwargs or {}))

    @property
    def engine(self) -> Engine:
        return self.engine_for()

    def close(self) -> None:
        """Close the shared engine this model uses (every model sharing it is affected)."""
        from langchain_minisgl._engines import close_engine

        close_engine(self._config)

    def _sampling_dict(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        return {k: kwargs.get(k, getattr(self, k)) for k in self.sampling_names}

    def sampling_value(self, name: str, kwargs: dict[str, Any]) -> Any:
        """A sampling field's value for one call: the call's option, else the model's."""
        return kwargs.get(name, getattr(self, name))

    def sampling_params(
        self, stop: Sequence[str] | None, kwargs: dict[str, Any], processors: Sequence[Callable] = ()
    ) -> SamplingParams:
        stops = list(self.stop or []) + [s for s in (stop or []) if s not in (self.stop or [])]
        return self.params_cls(
            **self._sampling_dict(kwargs), stop=tuple(stops), logits_processors=tuple(processors)
        )

    def check_call_kwargs(self, kwargs: dict[str, Any], extra: Sequence[str] = ()) -> None:
        """Per-call options are sampling fields, `model` and the class's own; anything else is a mistake."""
        allowed = set(self.sampling_names) | {"model"} | set(extra)
        unknown = sorted(k for k in kwargs if k not in allowed and not k.startswith("ls_"))
        if unknown:
            raise TypeError(f"unknown per-call option(s) {unknown}; accepted: {', '.join(sorted(allowed))}")

    # ------------------------------------------------------------------ running requests
    def run_sync(
        self, kwargs: dict[str, Any], submit: Callable[[Engine], list[RequestHandle]]
    ) -> list[RequestOutput]:
        """Submit (all requests at once) and wait; a dead engine is replaced up to max_retries times."""
        for attempt in range(self.max_retries + 1):
            engine = self.engine_for(kwargs)
            try:
                return wait_all(engine, submit(engine), self.timeout)
            except EngineDeadError:
                if attempt == self.max_retries:
                    raise
                evict_engine(self._config_for(kwargs), engine)
        raise AssertionError("unreachable")

    async def run_async(
        self, kwargs: dict[str, Any], submit: Callable[[Engine], list[RequestHandle]]
    ) -> list[RequestOutput]:
        for attempt in range(self.max_retries + 1):
            engine = await asyncio.to_thread(self.engine_for, kwargs)  # first use loads the model: seconds
            try:
                handles = submit(engine)
                return await asyncio.wait_for(
                    asyncio.gather(*(await_handle(engine, h) for h in handles)), self.timeout
                )
            except EngineDeadError:
                if attempt == self.max_retries:
                    raise
                evict_engine(self._config_for(kwargs), engine)
        raise AssertionError("unreachable")


def wait_all(engine: Engine, handles: list[RequestHandle], timeout: float | None) -> list[RequestOutput]:
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        return [
            h.result(None if deadline is None else max(0.0, deadline - time.monotonic())) for h in handles
        ]
    finally:
        for h in handles:  # interrupted or failed: free the engine's blocks of the rest
            if not h.done():
                engine.abort(h.request_id)


def check_streamable(params: SamplingParams) -> None:
    """A LangChain stream is one generation: n > 1 would interleave n of them (OpenAI's client
    refuses it too)."""
    if params.n != 1:
        raise InvalidSamplingParamsError(f"n must be 1 when streaming (one generation), got {params.n}")


def stream_sync(engine: Engine, handle: RequestHandle) -> Iterator[StreamDelta]:
    """Deltas of one request; stopping early (break, exception, generator close) aborts it."""
    try:
        yield from handle
    finally:
        if not handle.done():
            engine.abort(handle.request_id)


async def await_handle(engine: Engine, handle: RequestHandle) -> RequestOutput:
    """Await a request without blocking the event loop; cancelling the awaiter aborts the request."""
    try:
        return await result_future(handle)
    finally:
        if not handle.done():
            engine.abort(handle.request_id)


async def stream_async(engine: Engine, handle: RequestHandle) -> AsyncIterator[StreamDelta]:
    """Deltas of one request in asyncio. A pump thread blocks on the handle and hands each delta to
    the loop with call_soon_threadsafe; cancelling or closing the stream aborts the request."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[StreamDelta | BaseException] = asyncio.Queue()

    def pump() -> None:
        try:
            for delta in handle:
                call_soon(loop, queue.put_nowait, delta)
        except BaseException as e:  # noqa: BLE001 - re-raised in the consuming task
            call_soon(loop, queue.put_nowait, e)

    threading.Thread(target=pump, name=f"minisgl-lc-{handle.request_id}", daemon=True).start()
    try:
        while True:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finished:
                return
    finally:
        if not handle.done():
            engine.abort(handle.request_id)


def usage_of(outs: Sequence[RequestOutput]) -> dict[str, int]:
    """Each prompt once, the tokens of every sample."""
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(s.token_ids) for o in outs for s in o.samples)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def params_model(params_cls: type[SamplingParams] = SamplingParams) -> type[_ParamsBase]:
    """The LangChain fields: _ParamsBase's plus a pydantic field for each sampling field LangChain
    offers (default, bounds and description from `params_cls`), each also a per-call option."""
    fields = {k: f for k, f in surface_fields("langchain", params_cls).items() if k not in _OWN}
    model = create_model(
        "MiniSGLParams",
        __base__=_ParamsBase,
        __module__=__name__,
        __doc__=_ParamsBase.__doc__,
        **pydantic_fields(fields, _DEFAULTS),
    )
    model.params_cls = params_cls
    model.sampling_names = tuple(fields)
    return model


if TYPE_CHECKING:
    MiniSGLParams = _ParamsBase
else:
    MiniSGLParams = params_model()
# Per-call keyword arguments (invoke(..., max_tokens=5), .bind(temperature=0)) that map to sampling.
SAMPLING_FIELDS = MiniSGLParams.sampling_names
