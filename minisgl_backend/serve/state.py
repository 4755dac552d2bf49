"""What the routes of one app share (`ServerState`, on `app.state.server`), the dependencies that hand
it to them (`AppState`, `require_api_key`), and the checks of a request against its limits."""

from __future__ import annotations

import asyncio
import copy
import hmac
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Depends, Request

from minisgl_backend.chat.logprobs import TokenText
from minisgl_backend.serve.backend import Backend, ServerShuttingDownError, public_model_ref
from minisgl_backend.serve.errors import ERROR_RESPONSES, APIError, MappedRoute
from minisgl_backend.serve.guard import ServeLimits

T = TypeVar("T")


class DaemonExecutor(Executor):
    """A fixed set of daemon worker threads, started at the first job. A job still running when the
    process exits is abandoned: ThreadPoolExecutor's threads are joined at exit, so one long
    tokenising job would hold the server's stop up past its --shutdown-timeout."""

    def __init__(self, workers: int, name: str) -> None:
        self._workers, self._name = max(1, workers), name
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._shut = False

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        with self._lock:
            if self._shut:
                raise RuntimeError("cannot schedule new futures after shutdown")
            if not self._threads:
                for i in range(self._workers):
                    t = threading.Thread(target=self._work, name=f"{self._name}_{i}", daemon=True)
                    t.start()
                    self._threads.append(t)
            fut: Future[T] = Future()
            self._queue.put(_Job(fut, fn, args, kwargs))
            return fut

    def _work(self) -> None:
        while (job := self._queue.get()) is not None:
            if job.future.set_running_or_notify_cancel():  # False: cancelled while queued
                try:
                    job.future.set_result(job.fn(*job.args, **job.kwargs))
                except BaseException as e:  # noqa: BLE001 - handed to the caller, as Executor does
                    job.future.set_exception(e)
            del job  # the finished job's arguments and result are not kept while the thread waits

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._shut = True
            threads = list(self._threads)
        if cancel_futures:
            while True:
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job.future.cancel()
        for _ in threads:
            self._queue.put(None)
        if wait:
            for t in threads:
                t.join()


@dataclass
class _Job:
    future: Future
    fn: Callable[..., Any]
    args: tuple
    kwargs: dict


class CPUPool:
    """The bounded executor for request-sized CPU work (JSON of large bodies, tokenising, chat
    templates, grammar compilation, detokenising): the event loop only does I/O. Each worker thread
    encodes with its own copy of the tokenizer (a fast tokenizer is not meant for concurrent use);
    the Rust encoder releases the GIL, so a long encode does not hold the loop up either."""

    def __init__(self, tokenizer: Any, workers: int) -> None:
        self._base = tokenizer
        self._local = threading.local()
        self._lock = threading.Lock()
        self._pool = DaemonExecutor(workers, "minisgl-serve-cpu")
        self._stop: asyncio.Event | None = None  # made on the event loop, at first use

    def tokenizer(self) -> Any:
        """This worker's tokenizer (call it on a worker thread)."""
        tok = getattr(self._local, "tok", None)
        if tok is None:
            with self._lock:
                tok = self._local.tok = copy.deepcopy(self._base)
        return tok

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on a worker. Once `stop()` was called the caller gets ServerShuttingDownError
        at once (a 503) instead of waiting on work queued behind a long job: the server's stop would
        otherwise cancel the request and its client would get no error object."""
        if self._stop is None:
            self._stop = asyncio.Event()
        if self._stop.is_set():
            raise ServerShuttingDownError("the server is shutting down")
        job = asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        stop = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait((job, stop), return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if not job.done():
            job.cancel()  # dropped unstarted; one already running finishes and is discarded
            raise ServerShuttingDownError("the server is shutting down")
        return job.result()

    async def answer(self, fn: Callable[..., str]) -> str:
        """`fn()` on a worker, whether or not `stop()` was called: it builds the answer to work that
        is done (a result the engine already gave), which a stopping server still sends."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    def stop(self) -> None:
        """Callers waiting in `run`, and later ones, get ServerShuttingDownError (on the event loop)."""
        if self._stop is None:
            self._stop = asyncio.Event()
        self._stop.set()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class ServerState:
    """The backend and the app's own settings."""

    backend: Backend
    model_name: str
    tokenizer: Any  # the event loop's own copy (the engine's may be encoding on other threads)
    pool: CPUPool
    token_text: TokenText  # per-token strings for logprobs, cached
    # The most characters one token stands for (the longest vocabulary entry): a text longer than
    # max_model_len times this cannot fit the context, whatever it tokenises to.
    max_token_chars: int
    api_key: str | None = None
    owns_backend: bool = False
    limits: ServeLimits = field(default_factory=ServeLimits)
    # --reasoning-parser: a chat reply's leading <think>...</think> goes to the message's `reasoning`
    reasoning: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def for_backend(
        cls,
        backend: Backend,
        model_name: str | None,
        api_key: str | None,
        owns_backend: bool,
        limits: ServeLimits,
        reasoning: bool = False,
    ) -> ServerState:
        if api_key is not None and not api_key.strip():
            raise ValueError("the API key is empty: the server would accept any client; pass None for no key")
        tokenizer = copy.deepcopy(backend.tokenizer)
        return cls(
            backend=backend,
            model_name=model_name or public_model_ref(backend.model_ref),
            tokenizer=tokenizer,
            pool=CPUPool(backend.tokenizer, limits.cpu_workers),
            token_text=TokenText(tokenizer),
            max_token_chars=max(1, max(map(len, tokenizer.get_vocab()), default=1)),
            api_key=api_key,
            owns_backend=owns_backend,
            limits=limits,
            reasoning=reasoning,
        )

    # ------------------------------------------------------------------ checks of a request
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def check_logprobs(self, k: int | None, param: str) -> None:
        """A 400 naming `param` when a request asks for more alternatives than the engine's
        max_logprobs (the one limit: vLLM's --max-logprobs)."""
        cap = self.backend.max_logprobs
        if k is not None and k > cap:
            raise APIError(
                400,
                f"{param} must be at most {cap} (the server's max_logprobs, --max-logprobs), got {k}",
                param=param,
                code="invalid_sampling_params",
            )

    def check_sequences(self, prompts: int, n: int) -> None:
        lim = self.limits
        if prompts > lim.max_prompts:
            raise APIError(
                400,
                f"{prompts} prompts in one request; this server takes at most {lim.max_prompts} "
                "(--max-prompts)",
                param="prompt",
                code="too_many_prompts",
            )
        if prompts * n > lim.max_sequences:
            raise APIError(
                400,
                f"{prompts} prompts x n={n} = {prompts * n} sequences; this server takes at most "
                f"{lim.max_sequences} per request (--max-sequences)",
                param="n",
                code="too_many_sequences",
            )

    def check_chars(self, chars: int, what: str, param: str) -> None:
        """The cheap bound before tokenising: more characters than max_model_len tokens can hold."""
        limit = self.backend.max_model_len
        if chars > limit * self.max_token_chars:
            raise _context_error(
                f"{what} has {chars} characters, more than max_model_len ({limit}) "
                f"tokens can hold (at most {self.max_token_chars} characters each)",
                param,
            )

    def check_request_chars(self, chars: int, what: str, param: str) -> None:
        """The bound on what one request may have tokenised in all (--max-request-chars), checked
        before any of it is: many prompts each within the context, or a long /tokenize text, would
        otherwise hold the tokenizer threads that every other request waits for."""
        limit = self.limits.max_request_chars
        if chars > limit:
            raise APIError(
                400,
                f"{what} has {chars} characters in all; this server tokenises at most {limit} per "
                "request (--max-request-chars)",
                param=param,
                code="request_too_long",
            )

    def reply_budget(self, prompt_len: int, requested: int | None, what: str) -> int:
        """max_tokens for a prompt of `prompt_len` tokens: `requested` if it fits the context (else
        a 400, as vLLM), or all the room left when the client asked for no particular number. `what`
        names the input with its article ("the prompt", "prompt 2", "the conversation")."""
        limit = self.backend.max_model_len
        if prompt_len > limit:
            raise _context_error(
                f"{what} has {prompt_len} tokens but the context limit (max_model_len) is {limit}"
            )
        if requested is None:
            if prompt_len >= limit:
                raise _context_error(
                    f"{what} has {prompt_len} tokens: no room for a reply in max_model_len ({limit})"
                )
            return limit - prompt_len
        if prompt_len + requested > limit:
            raise _context_error(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + requested} tokens ({prompt_len} in {what}, {requested} in the "
                "completion). Please reduce the length of the prompt or completion.",
                "max_tokens",
            )
        return requested


def _context_error(msg: str, param: str | None = None) -> APIError:
    return APIError(400, msg, param=param, code="context_length_exceeded")


# ---------------------------------------------------------------------------------------------- dependencies
def server_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.server
    return state


AppState = Annotated[ServerState, Depends(server_state)]


async def require_api_key(request: Request, state: AppState) -> None:
    """With an API key set, every route but the probes and the docs needs `Authorization: Bearer <key>`."""
    if state.api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    # compare_digest: the time taken does not tell a client how much of its guess matched
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), state.api_key.encode()):
        raise APIError(
            401,
            "invalid or missing API key: send 'Authorization: Bearer <key>'",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )


def keyed_router() -> APIRouter:
    """A router whose routes need the API key and answer every failure with OpenAI's error object."""
    return APIRouter(
        route_class=MappedRoute, dependencies=[Depends(require_api_key)], responses=ERROR_RESPONSES
    )
