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

The pieces: ray_replica.py (the engine deployments), ray_ingress.py (the ingress and its routing);
this module deploys them as one application and runs it for the command.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import threading
from dataclasses import dataclass
from typing import Any

from minisgl_backend.cluster import connect, import_ray, import_serve, replica_resources
from minisgl_backend.cluster.placement import check_count
from minisgl_backend.config import EngineConfig
from minisgl_backend.errors import ConfigError, MiniSGLError
from minisgl_backend.serve.backend import public_model_ref
from minisgl_backend.serve.ray_ingress import Ingress
from minisgl_backend.serve.ray_replica import FEATURE, ServeReplica

log = logging.getLogger("minisgl.serve")


class DeployError(MiniSGLError, RuntimeError):
    """Serve could not start the replicas or the ingress (Serve's own error chained)."""


APP_NAME = "minisgl"
# Concurrent calls Serve lets through to one deployment replica before queueing them in the handle;
# the engine's own bound (max_waiting_requests -> 503) is the one that should apply.
MAX_ONGOING = 100_000


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
    extra_hosts: Any = None,
    reasoning_parser: str | None = None,
) -> RayServer:
    """Deploy the `minisgl` application (N engine replicas + the ingress) and wait until it serves.
    Connects to Ray first (`cluster.connect`: the session already initialised, `ray_address` /
    RAY_ADDRESS, or a new local cluster). Serve is started with `host:port` unless it already runs on
    the cluster, in which case its proxies' address applies. `extra_hosts`: `Host` names answered
    besides the loopback names and the address served on (--allowed-hosts). `reasoning_parser`: as
    build_app's (chat replies' <think> traces go to `reasoning`)."""
    check_count(replicas, "--replicas")
    ray = import_ray(FEATURE)
    serve = import_serve(FEATURE)
    from minisgl_backend.model.loader import resolve_model_dir
    from minisgl_backend.serve.guard import allowed_hosts

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
                ingress_cls.bind(
                    cfg_dict,
                    model_name,
                    api_key,
                    *engines,
                    limits=limits,
                    allowed_hosts=allowed_hosts(host, extra_hosts),
                    reasoning_parser=reasoning_parser,
                ),
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

        client = _get_global_client()
        if client is None:  # no Serve instance is running in this process's cluster
            return host, port
        opts = client.http_config
        return opts.host, opts.port
    except Exception:  # noqa: BLE001
        return host, port


def _drain(server: RayServer, timeout: float, now: threading.Event) -> None:
    """The ingress's drain, waited for until it ends or `now` is set (a second signal)."""
    log.info("minisgl serve: stopping: new requests get a 503; those in flight have up to %g s", timeout)
    call = server.ingress.drain.remote(timeout)
    while not now.is_set():
        try:
            left = call.result(timeout_s=0.5)
        except TimeoutError:
            continue
        except Exception as e:  # noqa: BLE001 - stopping anyway
            log.warning("minisgl serve: the ingress did not drain: %s", e)
            return
        if left:
            log.warning("%d requests still in flight after %g s: aborted", left, timeout)
        return


def serve_until_signalled(
    server: RayServer, model: str, model_name: str | None, shutdown_timeout: float = 0.0
) -> None:
    """`minisgl serve --replicas N` once `deploy` returned: serve until SIGINT/SIGTERM, then stop
    (streams end with finish_reason "abort", the application is deleted, the Ray cluster this
    command started is shut down). Blocks. `model`: the engine's model reference, for the banner.
    `shutdown_timeout` > 0: the signal first drains (`Ingress.drain`: new requests get a 503, the
    ones in flight up to that many seconds); a second signal stops at once."""
    stop, now = threading.Event(), threading.Event()

    def on_signal(*_: Any) -> None:
        (now if stop.is_set() else stop).set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    ray = import_ray(FEATURE)
    if log.level == logging.NOTSET:  # the banner and the stop lines are INFO, shown by default
        log.setLevel(logging.INFO)
    log.info(
        "minisgl serve: %s on %s/v1, %d engine replicas on Ray Serve (model %r); Ray cluster %s (%s)",
        model,
        server.url,
        server.n,
        model_name or model,
        ray.get_runtime_context().gcs_address,
        "started by this command" if server.started_cluster else "joined",
    )
    try:
        while not stop.wait(0.5):
            pass
        if shutdown_timeout > 0:
            _drain(server, shutdown_timeout, now)
    finally:
        log.info("minisgl serve: stopping")
        server.stop()
        log.info("minisgl serve: stopped")
