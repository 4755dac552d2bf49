"""N engine replicas as plain Ray actors behind the Engine's batch interface (`generate`,
`tokenizer`, `max_model_len`, `config`, `model_dir`, `metrics`, `close`): lm-eval's
`data_parallel_size=N` swaps a ReplicaSet in for its in-process Engine.

Each request batch is split by `routing.route`; every replica runs its whole share at once.

Failure bound: the driver keeps one `collect` call per busy replica in flight; each returns within
about `replica.COLLECT_WAIT_S` even when nothing finished. A replica whose actor died (killed,
crashed) is reported at once (Ray fails its pending call); one whose engine died (EngineDeadError,
e.g. the stall watchdog) too; one that does not answer for `timeout_s` is declared hung. Each raises
ReplicaFailedError naming the replica and the cause; the other replicas' requests are aborted and
no partial result is returned.
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import logging
import time
from collections.abc import Sequence
from typing import Any

from minisgl_backend.cluster.placement import check_count, replica_resources
from minisgl_backend.cluster.replica import EngineReplica, ReplicaFailedError, unwrap_failure
from minisgl_backend.cluster.routing import route
from minisgl_backend.cluster.session import connect, import_ray
from minisgl_backend.config import EngineConfig
from minisgl_backend.errors import ConfigError, EngineDeadError, MiniSGLError
from minisgl_backend.types import RequestOutput, SamplingParams

log = logging.getLogger("minisgl.cluster")

DEFAULT_TIMEOUT_S = 120.0  # a replica silent this long (no answer to collect) is declared hung
START_TIMEOUT_S = 900.0  # replicas must have loaded their engine by then (or Ray could not place them)


class ReplicaSet:
    """`n` EngineReplica actors on the Ray cluster at `address` (see `session.connect`). `knob` is the
    setting that asked for them (`data_parallel_size`): errors and log lines name it."""

    def __init__(
        self,
        config: EngineConfig,
        n: int,
        knob: str,
        address: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        start_timeout_s: float = START_TIMEOUT_S,
    ) -> None:
        self.n = check_count(n, knob)
        self.knob = knob
        ray = self._ray = import_ray(f"{knob} > 1")
        self.timeout_s = float(timeout_s)
        self._closed = False
        self._failed: ReplicaFailedError | None = None
        self._jobs = itertools.count()
        self.actors: list[Any] = []
        self._owns_ray = connect(ray, address)
        if not self._owns_ray:
            log.info("%s=%d: using the Ray session already initialised", knob, n)
        atexit.register(self.close)
        try:
            self._start(config, start_timeout_s)
        except BaseException:
            self.close()
            raise

    def _start(self, config: EngineConfig, start_timeout_s: float) -> None:
        ray, n = self._ray, self.n
        config, num_cpus, gpus = replica_resources(ray, config, n, self.knob)
        self.config = config
        actor_cls = ray.remote(EngineReplica)
        self.actors = [
            actor_cls.options(num_cpus=num_cpus, num_gpus=gpus, max_restarts=0).remote(
                dataclasses.asdict(config), r
            )
            for r in range(n)
        ]
        refs = [a.info.remote() for a in self.actors]
        ready, _ = ray.wait(refs, num_returns=n, timeout=start_timeout_s)
        infos = []
        for r, ref in enumerate(refs):
            if ref not in ready:
                raise ReplicaFailedError(
                    r,
                    f"did not load its engine within {start_timeout_s:.0f} s (each replica asks Ray for "
                    f"num_cpus={num_cpus}, num_gpus={gpus}; cluster: {ray.cluster_resources()})",
                )
            infos.append(self._get(r, ref))
        self.infos = infos
        self.max_model_len = min(i["max_model_len"] for i in infos)
        self.num_blocks = infos[0]["num_blocks"]
        from minisgl_backend.model.loader import load_tokenizer, resolve_model_dir

        # Resolved on this node (the replicas' model_dir is a path on theirs).
        self.model_dir = resolve_model_dir(config.model)
        self.tokenizer = load_tokenizer(self.model_dir)
        log.info("%s=%d: %d Ray replicas ready, %d threads each", self.knob, n, n, config.num_threads)

    # --------------------------------------------------------------------------------- requests
    def _get(self, r: int, ref: Any) -> Any:
        ray = self._ray
        try:
            return ray.get(ref, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise self._fail(r, f"no answer for {self.timeout_s:.0f} s (hung?)") from None
        except ray.exceptions.RayError as e:
            cause, dead = unwrap_failure(ray, e)
            if dead is None and isinstance(cause, MiniSGLError):
                raise cause from None  # a bad request: the same typed error as in process
            raise self._fail(r, dead or f"{type(cause).__name__}: {cause}") from cause

    def _fail(self, r: int, message: str) -> ReplicaFailedError:
        self._failed = ReplicaFailedError(r, message)
        return self._failed

    def generate(
        self,
        prompts: Sequence[list[int]],
        params: Sequence[SamplingParams],
        use_tqdm: bool = True,
        desc: str = "minisgl generate",
    ) -> list[RequestOutput]:
        """Run the requests on the replicas (split by `route`); outputs in input order."""
        if self._closed:
            raise EngineDeadError("the data-parallel replicas are closed")
        if self._failed is not None:
            raise self._failed
        prompts, params = list(prompts), list(params)
        if len(params) != len(prompts):
            raise ConfigError(f"{len(params)} sampling params for {len(prompts)} prompts")
        if not prompts:
            return []
        ray = self._ray
        shares = route(prompts, params, self.n, self.config.block_size)
        job = next(self._jobs)
        busy = [r for r in range(self.n) if shares[r]]
        outputs: list[RequestOutput | None] = [None] * len(prompts)
        started = {
            r: self.actors[r].start.remote(
                job, [prompts[i] for i in shares[r]], [params[i] for i in shares[r]]
            )
            for r in busy
        }
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(prompts), desc=f"{desc} (dp={self.n})", unit="req")
        try:
            for r in busy:
                self._get(r, started[r])
            left = {r: len(shares[r]) for r in busy}
            pending = {self.actors[r].collect.remote(job): r for r in busy}
            last = dict.fromkeys(busy, time.monotonic())
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=1.0)
                for ref in ready:
                    r = pending.pop(ref)
                    items = self._get(r, ref)
                    last[r] = time.monotonic()
                    for i, out in items:
                        outputs[shares[r][i]] = out
                    left[r] -= len(items)
                    if bar is not None:
                        bar.update(len(items))
                    if left[r] > 0:
                        pending[self.actors[r].collect.remote(job)] = r
                now = time.monotonic()
                for r in pending.values():
                    if now - last[r] > self.timeout_s:
                        raise self._fail(r, f"no answer for {self.timeout_s:.0f} s (hung?)")
        except BaseException:
            for r in busy:
                if self._failed is None or r != self._failed.replica:
                    self.actors[r].cancel.remote(job)
            raise
        finally:
            if bar is not None:
                bar.close()
        for r in busy:
            self.actors[r].finish.remote(job)
        missing = [i for i, out in enumerate(outputs) if out is None]
        if missing:  # an engine bug, never expected: no partial results
            raise EngineDeadError(f"{len(missing)} requests got no output from the replicas")
        return outputs  # type: ignore[return-value]

    def metrics(self) -> dict[str, float]:
        """Every replica's metrics, summed (counters and gauges alike)."""
        total: dict[str, float] = {}
        for r, actor in enumerate(self.actors):
            for key, value in self._get(r, actor.metrics.remote()).items():
                total[key] = total.get(key, 0) + value
        return total

    @property
    def is_alive(self) -> bool:
        return not self._closed and self._failed is None

    def close(self) -> None:
        """Stop the replicas; shut Ray down only if this set started it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        ray = self._ray
        if ray.is_initialized():
            for actor in self.actors:
                try:
                    ray.kill(actor)
                except Exception:  # noqa: BLE001 - already dead
                    pass
        self.actors = []
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
