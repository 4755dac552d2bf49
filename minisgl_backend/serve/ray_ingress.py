"""The ingress side of `minisgl serve --replicas N` (serve/ray_app.py): the single server's app
(serve/app.py) over a `RayBackend`, which routes each request to an engine replica
(cluster.routing.PrefixRouter) and reads its streaming call (`RayStream`).

A client that disconnects makes the app abort the stream, which cancels the call; the replica's
generator then aborts its engine request, whose blocks return to the pool. A replica found dead is
routed around and probed until Serve has restarted it. `/metrics` merges every replica's series
with a `replica` label; `/health` asks every replica and answers 503 naming those that are dead or
silent.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from minisgl_backend.cluster import (
    PrefixRouter,
    ReplicaFailedError,
    import_ray,
    serve_grpc_on_loopback,
    unwrap_failure,
)
from minisgl_backend.config import EngineConfig
from minisgl_backend.errors import EngineDeadError
from minisgl_backend.serve.backend import Backend, Event, ServerShuttingDownError, Stream, public_model_ref
from minisgl_backend.serve.ray_replica import FEATURE, portable
from minisgl_backend.types import RequestOutput

if TYPE_CHECKING:
    from minisgl_backend.serve.guard import Drain

PROBE_TIMEOUT_S = 5.0  # a replica that does not answer /health's or /metrics' probe this fast is reported


class RayStream(Stream):
    def __init__(self, backend: RayBackend, replica: int, call: Any, request_id: str) -> None:
        self.backend, self.replica, self.request_id = backend, replica, request_id
        self._call = call
        self._released = False
        self._finished = False

    def _release(self) -> None:
        if not self._released:
            self._released = True
            self.backend.router.release(self.replica)
            self.backend.live.discard(self)

    def _raise(self, e: BaseException) -> None:
        mapped = self.backend.replica_error(self.replica, e)
        if mapped is e:
            raise e
        raise mapped from e

    async def accepted(self) -> None:
        try:
            first = await self._call.__anext__()
        except BaseException as e:
            self._release()
            self._raise(e)
        if first:  # the engine refused it
            self._finished = True
            self._release()
            self._raise(first[0])

    async def events(self) -> AsyncIterator[Event]:
        try:
            async for items in self._call:
                for item in items:
                    if isinstance(item, BaseException):
                        self._finished = True
                        raise item
                    if isinstance(item, RequestOutput):
                        self._finished = True
                    yield item
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._raise(e)
        finally:
            self._release()

    async def result(self) -> RequestOutput:
        out = None
        async for ev in self.events():
            out = ev
        if not isinstance(out, RequestOutput):
            raise EngineDeadError(f"engine replica {self.replica} ended request {self.request_id} early")
        return out

    def abort(self) -> None:
        if not self._finished:
            self._call.cancel()
        self._release()


class RayBackend(Backend):
    """The ingress's view of the engine replicas (DeploymentHandles `engine-0` ...)."""

    def __init__(
        self,
        handles: Sequence[Any],
        infos: Sequence[dict[str, Any]],
        config: EngineConfig,
        model_name: str | None,
    ) -> None:
        from minisgl_backend.model.loader import load_tokenizer, resolve_model_dir

        self.ray = import_ray(FEATURE)
        self.handles = list(handles)
        self._streaming = [h.options(stream=True) for h in self.handles]  # made once: options() copies
        self.n = len(self.handles)
        self.model_ref = str(config.model)
        self.model_name = model_name or public_model_ref(self.model_ref)  # the metrics' model_name label
        # Each replica's process: a probe that finds another one there reports the replica lost once
        # (Serve may restart a killed replica faster than a probe's timeout, the request then waiting
        # for the new process and seeing nothing wrong).
        self.pids: list[int | None] = [i.get("pid") for i in infos]
        self.model_dir = infos[0]["model_dir"]
        self.max_model_len = min(i["max_model_len"] for i in infos)
        self.vocab_size = infos[0]["vocab_size"]
        self.max_logprobs = config.max_logprobs
        # Resolved on this node (the replicas' model_dir is a path on theirs).
        self.tokenizer = load_tokenizer(resolve_model_dir(config.model))
        # Up to max_num_seqs requests beyond the idlest replica, the one holding a prompt's prefix
        # can still batch them: only past that does a request leave its prefix's replica.
        self.router = PrefixRouter(self.n, config.block_size, balance=config.max_num_seqs)
        self.dead: dict[int, str] = {}  # replica -> why, until a probe finds it serving again
        self.live: set[RayStream] = set()
        self.shutting_down = False
        self._reprobe: asyncio.Task | None = None
        self._shutdown_calls: list[Any] = []

    # ---------------------------------------------------------------- requests
    def _route_ids(self, prompt: Any) -> list[int] | None:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        return list(prompt) if isinstance(prompt, list) else None

    async def submit(self, prompts, params, request_ids, user, stream) -> list[Stream]:
        if self.shutting_down:
            raise ServerShuttingDownError("the server is shutting down")
        streams: list[RayStream] = []
        try:
            for p, sp, rid in zip(prompts, params, request_ids):
                bare, grammars = portable(sp)
                alive = [r for r in range(self.n) if r not in self.dead]
                r = self.router.pick(self._route_ids(p), alive)
                try:
                    call = self._streaming[r].run.remote(p, bare, grammars, rid, user, stream)
                except BaseException:
                    self.router.release(r)
                    raise
                s = RayStream(self, r, call, rid)
                self.live.add(s)
                streams.append(s)
            await asyncio.gather(*(s.accepted() for s in streams))
        except BaseException:
            for s in streams:
                s.abort()
            raise
        return list(streams)

    def replica_error(self, r: int, e: BaseException) -> BaseException:
        """The error a route should see for a failed replica call: the engine's own typed error
        (a bad request stays a 400), or EngineDeadError naming the replica when it died."""
        cause, dead = unwrap_failure(self.ray, e)
        if dead is None:
            return cause
        self.dead[r] = dead
        if self._reprobe is None or self._reprobe.done():  # until it serves again (Serve restarts it)
            self._reprobe = asyncio.ensure_future(self._reprobe_dead())
        return ReplicaFailedError(r, dead)

    async def _reprobe_dead(self) -> None:
        while self.dead and not self.shutting_down:
            await asyncio.sleep(1.0)
            await self.probe()

    # ---------------------------------------------------------------- probes
    async def _ask(self, r: int, method: str) -> Any:
        call = getattr(self.handles[r], method).remote()
        try:
            return await asyncio.wait_for(_await(call), PROBE_TIMEOUT_S)
        except TimeoutError:
            call.cancel()
            raise TimeoutError(f"no answer within {PROBE_TIMEOUT_S:g} s") from None

    async def probe(self) -> dict[int, str]:
        """Ask every replica whether its engine serves; updates and returns `dead`."""
        results = await asyncio.gather(
            *(self._ask(r, "health") for r in range(self.n)), return_exceptions=True
        )
        for r, res in enumerate(results):
            if isinstance(res, BaseException):
                cause = getattr(res, "cause", None) or res
                self.dead[r] = f"{type(cause).__name__}: {cause}"
            elif isinstance(res, int) and self.pids[r] is not None and res != self.pids[r]:
                self.dead[r] = f"its process {self.pids[r]} was lost; Serve restarted it as {res}"
                self.pids[r] = res
            else:
                self.dead.pop(r, None)
        return dict(self.dead)

    async def unhealthy(self) -> str | None:
        dead = await self.probe()
        if not dead:
            return None
        return "; ".join(f"engine replica {r} is not serving ({why})" for r, why in sorted(dead.items()))

    async def render_metrics(self) -> tuple[bytes, str]:
        from minisgl_backend.serve.metrics import render_replicas

        results = await asyncio.gather(
            *(self._ask(r, "metric_families") for r in range(self.n)), return_exceptions=True
        )
        per_replica = [None if isinstance(res, BaseException) else res for res in results]
        return render_replicas(per_replica, self.model_name)

    # ---------------------------------------------------------------- lifecycle
    def begin_shutdown(self) -> None:
        self.shutting_down = True
        self._shutdown_calls = [h.begin_shutdown.remote() for h in self.handles]

    async def wait_idle(self, timeout: float) -> int:
        """Wait up to `timeout` for the replicas to take the shutdown and every stream to end;
        returns how many streams are still open."""
        deadline = time.monotonic() + timeout
        await asyncio.gather(*(_await(c) for c in self._shutdown_calls), return_exceptions=True)
        while self.live and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return len(self.live)

    def close(self) -> None:
        pass  # the replicas belong to Serve, which stops them with the application


async def _await(call: Any) -> Any:
    return await call


class Ingress:
    """The ingress deployment: the single server's app over a RayBackend."""

    async def __init__(  # type: ignore[misc]  # Ray Serve awaits a deployment's async constructor
        self,
        config: dict[str, Any],
        model_name: str | None,
        api_key: str | None,
        *handles: Any,
        limits: Any = None,
        allowed_hosts: frozenset[str] | None = None,
        reasoning_parser: str | None = None,
    ) -> None:
        from minisgl_backend.serve.app import build_app

        serve_grpc_on_loopback(FEATURE)
        cfg = EngineConfig.from_dict(config)
        infos = await asyncio.gather(*(_await(h.info.remote()) for h in handles))
        self.backend = RayBackend(handles, infos, cfg, model_name)
        self._app = build_app(
            self.backend,
            model_name,
            api_key,
            limits=limits,
            allowed_hosts=allowed_hosts,
            reasoning_parser=reasoning_parser,
        )

    def __serve_build_asgi_app__(self) -> Any:
        return self._app

    async def drain(self, timeout: float) -> int:
        """--shutdown-timeout: from now on every request that arrives gets a 503 `shutting_down`
        (the single server's drain, serve/guard.py); wait up to `timeout` seconds for the ones in
        flight to end. Returns how many did not."""
        drain: Drain = self._app.state.drain
        return await drain.wait_idle(timeout)

    async def begin_shutdown(self, timeout: float) -> int:
        """Refuse new requests, abort the running ones on every replica and wait for the open
        streams to end (with finish_reason "abort"); returns how many did not end in time."""
        self.backend.begin_shutdown()
        return await self.backend.wait_idle(timeout)
