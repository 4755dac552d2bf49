"""`minisgl serve --replicas N`: N engine replicas as Ray Serve deployments behind one ingress.

One Serve application, `minisgl`, on the cluster's Serve HTTP proxy (127.0.0.1:8000 unless told):

```
client --HTTP--> Serve proxy --> ingress (one replica, 0 CPUs): the app of serve/app.py over a RayBackend
                                   | PrefixRouter picks a replica per prompt
                                   +--handle.run (a streaming call)--> engine-0 ... engine-(N-1)
                                                                       (each: one Engine + EngineBackend,
                                                                        num_cpus = its core share)
```

The ingress runs the same route handlers as the single server (validation, chat templates, tool
grammars, OpenAI error objects, --api-key): only the Backend differs. Each engine replica is its own
Serve deployment of one replica (`engine-<i>`), so the ingress, not Serve's own random choice,
decides where a request goes, and tests and metrics can name a replica.

Routing (cluster.routing.PrefixRouter): a prompt goes to the replica that rendezvous hashing picks
for its first KV block (so prompts sharing a system prompt, a few-shot stem or a document land on
the replica whose prefix cache holds it) unless that replica is more than `balance` requests busier
than the least loaded one. `balance` is the engine's `max_num_seqs`: below that the preferred
replica can still batch the extra requests.

A replica call is a Ray streaming generator: its first item (empty) says the engine accepted the
request, so validation errors and a full queue still become 400 / 503 before the response starts;
then lists of events, as many as were ready together. A client that disconnects makes the app abort
the stream, which cancels the call; the replica's generator then aborts its engine request, whose
blocks return to the pool. `/metrics` merges every replica's series with a `replica` label;
`/health` asks every replica and answers 503 naming those that are dead or silent.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from minisgl_backend.chat import GrammarError, GrammarProcessor
from minisgl_backend.cluster import (
    EngineReplica,
    PrefixRouter,
    ReplicaFailedError,
    connect,
    import_ray,
    import_serve,
    replica_resources,
    serve_grpc_on_loopback,
    unwrap_failure,
)
from minisgl_backend.cluster.placement import check_count
from minisgl_backend.config import EngineConfig
from minisgl_backend.errors import ConfigError, EngineDeadError, InvalidSamplingParamsError, MiniSGLError
from minisgl_backend.serve.backend import (
    Backend,
    EngineBackend,
    Event,
    ServerShuttingDownError,
    Stream,
    public_model_ref,
)
from minisgl_backend.types import RequestOutput, SamplingParams

log = logging.getLogger("minisgl.serve")


class DeployError(MiniSGLError, RuntimeError):
    """Serve could not start the replicas or the ingress (Serve's own error chained)."""


APP_NAME = "minisgl"
FEATURE = "minisgl serve --replicas"
PROBE_TIMEOUT_S = 5.0  # a replica that does not answer /health's or /metrics' probe this fast is reported
# Concurrent calls Serve lets through to one deployment replica before queueing them in the handle;
# the engine's own bound (max_waiting_requests -> 503) is the one that should apply.
MAX_ONGOING = 100_000


# ------------------------------------------------------------------------------------------ transport
def _portable(params: SamplingParams) -> tuple[SamplingParams, list[str]]:
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


# ------------------------------------------------------------------------------------------ replicas
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
    ) -> AsyncIterator[list[Event]]:
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

    def finished(self) -> list[Any]:
        """The newest finished requests' records (FinishedRecord), oldest first."""
        self.backend.collect()
        return list(self.backend.finished)

    def __del__(self) -> None:
        backend = getattr(self, "backend", None)
        if backend is not None:
            backend.close()


# ------------------------------------------------------------------------------------------ ingress side
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
        self.model_dir = infos[0]["model_dir"]
        self.max_model_len = min(i["max_model_len"] for i in infos)
        self.vocab_size = infos[0]["vocab_size"]
        # Resolved on this node (the replicas' model_dir is a path on theirs).
        self.tokenizer = load_tokenizer(resolve_model_dir(config.model))
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
                bare, grammars = _portable(sp)
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

    async def __init__(
        self,
        config: dict[str, Any],
        model_name: str | None,
        api_key: str | None,
        *handles: Any,
        limits: Any = None,
    ) -> None:
        from minisgl_backend.serve.app import build_app

        serve_grpc_on_loopback(FEATURE)
        cfg = EngineConfig.from_dict(config)
        infos = await asyncio.gather(*(_await(h.info.remote()) for h in handles))
        self.backend = RayBackend(handles, infos, cfg, model_name)
        self._app = build_app(self.backend, model_name, api_key, limits=limits)

    def __serve_build_asgi_app__(self) -> Any:
        return self._app

    async def begin_shutdown(self, timeout: float) -> int:
        """Refuse new requests, abort the running ones on every replica and wait for the open
        streams to end (with finish_reason "abort"); returns how many did not end in time."""
        self.backend.begin_shutdown()
        return await self.backend.wait_idle(timeout)


# ------------------------------------------------------------------------------------------ deployment
@dataclass
class RayServer:
    """A deployed `minisgl` Serve application: `.url`, `.replicas` (DeploymentHandles of the engine
    replicas, for `drain` / `finished` / `info`), `.stop()`."""

    url: str
    n: int
    ingress: Any
    replicas: list[Any]
    owns_serve: bool  # Serve was started for this server (stop() shuts it down)
    owns_ray: bool  # this process initialised its Ray session (stop() ends it)
    started_cluster: bool  # ... by starting a local cluster, which ray.shutdown() then stops
    stopped: bool = False

    def call(self, r: int, method: str, *args: Any, timeout: float = 120) -> Any:
        """A method of engine replica `r`, from a driver (blocking)."""
        return getattr(self.replicas[r], method).remote(*args).result(timeout_s=timeout)

    def stop(self, timeout: float = 10) -> None:
        """Abort what runs (open streams end with finish_reason "abort"), delete the application
        (and stop Serve if this server started it), and shut Ray down if this server started it."""
        if self.stopped:
            return
        self.stopped = True
        ray = import_ray(FEATURE)
        serve = import_serve(FEATURE)
        try:
            left = self.ingress.begin_shutdown.remote(timeout).result(timeout_s=timeout + 10)
            if left:
                log.warning("minisgl serve: %d streams were still open at shutdown", left)
        except Exception as e:  # noqa: BLE001 - stopping anyway
            log.warning("minisgl serve: the ingress did not shut down cleanly: %s", e)
        try:
            if self.owns_serve:
                serve.shutdown()
            else:
                serve.delete(APP_NAME)
        finally:
            if self.owns_ray and ray.is_initialized():
                ray.shutdown()


def deploy(
    config: EngineConfig,
    replicas: int,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    model_name: str | None = None,
    ray_address: str | None = None,
    limits: Any = None,
) -> RayServer:
    """Deploy the `minisgl` application (N engine replicas + the ingress) and wait until it serves.
    Connects to Ray first (`cluster.connect`: the session already initialised, `ray_address` /
    RAY_ADDRESS, or a new local cluster). Serve is started with `host:port` unless it already runs on
    the cluster, in which case its proxies' address applies."""
    check_count(replicas, "--replicas")
    ray = import_ray(FEATURE)
    serve = import_serve(FEATURE)
    from minisgl_backend.model.loader import resolve_model_dir

    resolve_model_dir(config.model)  # a GGUF is converted once here, not by every replica at once
    # Serve's driver-side INFO lines ("Connecting to existing Serve app ... will not be applied")
    # describe its internals, not this server.
    logging.getLogger("ray.serve").setLevel(logging.WARNING)
    address = ray_address or os.environ.get("RAY_ADDRESS")
    owns_ray = connect(ray, ray_address)
    started_cluster = owns_ray and address in (None, "", "local")
    owns_serve = False
    try:
        status = serve.status()
        if APP_NAME in status.applications:
            raise ConfigError(
                f"a Serve application named {APP_NAME!r} already runs on this Ray cluster; "
                f"stop it first (`serve shutdown`, or serve.delete({APP_NAME!r}))"
            )
        cfg, num_cpus, gpus = replica_resources(ray, config, replicas, "--replicas")
        if status.proxies:
            host, port = _running_http_address(host, port)
            log.warning("Serve already runs on this cluster: serving on its proxies at %s:%d", host, port)
        else:
            _check_port_free(host, port)
            serve.start(
                http_options={"host": host, "port": port},
                logging_config={"log_level": "WARNING"},
            )
            owns_serve = True
        engine_cls = serve.deployment(
            ServeReplica,
            ray_actor_options={"num_cpus": num_cpus, "num_gpus": gpus},
            max_ongoing_requests=MAX_ONGOING,
            health_check_period_s=2,
            health_check_timeout_s=30,
            graceful_shutdown_timeout_s=5,
            max_constructor_retry_count=1,  # a replica that cannot load its engine fails the deploy
        )
        ingress_cls = serve.deployment(
            serve.ingress()(Ingress),
            name="ingress",
            ray_actor_options={"num_cpus": 0},
            max_ongoing_requests=MAX_ONGOING,
            graceful_shutdown_timeout_s=5,
        )
        cfg_dict = dataclasses.asdict(cfg)
        engines = [
            engine_cls.options(name=f"engine-{r}").bind(
                cfg_dict, r, model_name or public_model_ref(str(cfg.model))
            )
            for r in range(replicas)
        ]
        try:
            ingress = serve.run(
                ingress_cls.bind(cfg_dict, model_name, api_key, *engines, limits=limits),
                name=APP_NAME,
                route_prefix="/",
            )
        except RuntimeError as e:  # Serve's "Deploying application ... failed"
            raise DeployError(
                f"the replicas did not start: {e} (their logs: logs/serve/ in the Ray session directory)"
            ) from e
        handles = [serve.get_deployment_handle(f"engine-{r}", app_name=APP_NAME) for r in range(replicas)]
    except BaseException:
        if owns_serve:
            serve.shutdown()
        if owns_ray:
            ray.shutdown()
        raise
    shown = f"[{host}]" if ":" in host else host
    return RayServer(
        f"http://{shown}:{port}", replicas, ingress, handles, owns_serve, owns_ray, started_cluster
    )


def _check_port_free(host: str, port: int) -> None:
    """Serve's proxy would retry a taken port forever; say so now, as the single server does."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            raise ConfigError(f"cannot serve on {host}:{port}: {e.strerror}") from e


def _running_http_address(host: str, port: int) -> tuple[str, int]:
    """The HTTP address of a Serve instance that was already running (falls back to what was asked)."""
    try:  # Serve has no public getter for its HTTP options
        from ray.serve.context import _get_global_client

        opts = _get_global_client().http_config
        return opts.host, opts.port
    except Exception:  # noqa: BLE001
        return host, port


def run_ray_server(
    config: EngineConfig,
    replicas: int,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    model_name: str | None = None,
    ray_address: str | None = None,
    limits: Any = None,
) -> None:
    """`minisgl serve --replicas N`: deploy, serve until SIGINT/SIGTERM, then stop (streams end with
    finish_reason "abort", the application is deleted, the Ray cluster this command started is shut
    down). Blocks. `limits`: the ingress app's ServeLimits (body size, prompts, sequences, streams;
    connections and header timeouts are Serve's proxy's own)."""
    stop = threading.Event()
    server = deploy(config, replicas, host, port, api_key, model_name, ray_address, limits)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    ray = import_ray(FEATURE)
    if log.level == logging.NOTSET:  # the banner and the stop lines are INFO, shown by default
        log.setLevel(logging.INFO)
    log.info(
        "minisgl serve: %s on %s/v1, %d engine replicas on Ray Serve (model %r); Ray cluster %s (%s)",
        config.model,
        server.url,
        replicas,
        model_name or str(config.model),
        ray.get_runtime_context().gcs_address,
        "started by this command" if server.started_cluster else "joined",
    )
    try:
        while not stop.wait(0.5):
            pass
    finally:
        log.info("minisgl serve: stopping")
        server.stop()
        log.info("minisgl serve: stopped")
