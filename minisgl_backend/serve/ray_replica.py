"""The engine side of `minisgl serve --replicas N` (serve/ray_app.py): each engine replica is a
Serve deployment of `ServeReplica`, the replica core's Engine (cluster.replica) with the single
server's books over it, answering one streaming call per request.

A call's first item (empty) says the engine accepted the request, so validation errors and a full
queue still become 400 / 503 before the response starts; then lists of events, as many as were
ready together. Logits processors do not pickle: a request's grammars travel as their source
(`portable`) and are rebuilt here.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence
from typing import Any

from minisgl_backend.chat import GrammarError, GrammarProcessor
from minisgl_backend.cluster import EngineReplica, serve_grpc_on_loopback
from minisgl_backend.errors import InvalidSamplingParamsError, MiniSGLError
from minisgl_backend.serve.backend import EngineBackend, Event
from minisgl_backend.types import SamplingParams

FEATURE = "minisgl serve --replicas"  # what needs Ray, in MissingExtraError's message


def portable(params: SamplingParams) -> tuple[SamplingParams, list[str]]:
    """SamplingParams without its logits processors, plus the grammars to rebuild them from: a
    processor holds native parser state that does not pickle, so only grammar processors can cross
    to a replica (as their grammar source)."""
    grammars = []
    for p in params.logits_processors:
        if not isinstance(p, GrammarProcessor):
            raise InvalidSamplingParamsError(
                f"a {type(p).__name__} logits processor cannot be sent to a Ray replica "
                "(only grammar constraints can)"
            )
        grammars.append(p.grammar)
    return dataclasses.replace(params, logits_processors=()), grammars


class ServeReplica(EngineReplica):
    """One engine replica (a Serve deployment of one replica): the replica core's Engine, with the
    single server's books over it (EngineBackend: request streams, finished records, metrics)."""

    def __init__(self, config: dict[str, Any], index: int, model_name: str) -> None:
        from minisgl_backend.serve.metrics import ServeMetrics

        serve_grpc_on_loopback(FEATURE)
        super().__init__(config, index)
        self.backend = EngineBackend(self.engine, ServeMetrics(self.engine, model_name), owns_engine=True)

    async def run(
        self,
        prompt: Any,
        params: SamplingParams,
        grammars: list[str],
        request_id: str,
        user: str | None,
        stream: bool,
    ) -> AsyncIterator[Sequence[Event | MiniSGLError | GrammarError]]:
        # The engine's typed errors travel as items, not raised: Serve would log each bad request
        # as a replica failure with its traceback.
        try:
            if grammars:
                procs = tuple(GrammarProcessor(self.backend.tokenizer, g) for g in grammars)
                params = dataclasses.replace(params, logits_processors=procs)
            (s,) = self.backend.submit_now([prompt], [params], [request_id], user)
        except (MiniSGLError, GrammarError) as e:
            yield [e]
            return
        yield []  # accepted
        try:
            if stream:
                async for items in s.batches():
                    yield items
            else:
                yield [await s.result()]
        except MiniSGLError as e:
            yield [e]
        finally:  # finished, failed, or cancelled by the ingress (its client went away)
            s.abort()

    def check_health(self) -> None:
        """Serve's periodic probe: a replica whose engine died is restarted by Serve."""
        self.health()

    def metric_families(self) -> list[Any]:
        return self.backend.metric_families()

    def begin_shutdown(self) -> None:
        self.backend.begin_shutdown()

    async def drain(self, timeout: float = 60, flush_cache: bool = False) -> dict[str, int]:
        """Engine.drain's block counts plus `num_blocks` (tests: every block FREE after a load)."""
        counts = await asyncio.to_thread(self.engine.drain, timeout, flush_cache)
        return {**counts, "num_blocks": self.engine.num_blocks}

    def keep_finished(self, n: int) -> None:
        """Keep records of the newest `n` finished requests (tests; none are kept otherwise)."""
        self.backend.keep_finished(n)

    def finished(self) -> list[Any]:
        """The newest finished requests' records (FinishedRecord), oldest first (see keep_finished)."""
        self.backend.collect()
        return list(self.backend.finished)

    def __del__(self) -> None:
        backend = getattr(self, "backend", None)
        if backend is not None:
            backend.close()
