"""Data-parallel replicas on Ray: `--model_args ...,data_parallel_size=N`.

N long-lived Ray actors (`EngineReplica`), each holding one Engine built once from the same
EngineConfig with its share of the cores, serve every request type of the run. `ReplicaSet` has the
few Engine attributes the adapter uses (`generate`, `tokenizer`, `max_model_len`, `config`,
`model_dir`, `metrics`, `close`), so the adapter swaps it in for the in-process Engine.

Routing (`route`): prompts are grouped by their first K tokens (K = one KV block), and a group that
holds more than one replica's fair share of the work is split again by a longer prefix (2K, 4K,
...). Groups go to replicas greedily, largest first, onto the least loaded one. So the choices of
one question and prompts with a long common stem land on one replica, whose prefix cache keeps its
hits; only a stem shared by more than 1/N of the work is prefilled once per replica.

Failure bound: the driver keeps one `collect` call per busy replica in flight; each returns within
about `_COLLECT_WAIT_S` even when nothing finished. A replica whose actor died (killed, crashed) is
reported at once (Ray fails its pending call); one whose engine died (EngineDeadError, e.g. the
stall watchdog) too; one that does not answer for `timeout_s` is declared hung. Each raises
ReplicaFailedError naming the replica and the cause; the other replicas' requests are aborted and
no partial result is returned.
"""

from __future__ import annotations

import atexit
import dataclasses
import heapq
import itertools
import logging
import os
import queue
import time
from collections.abc import Sequence
from typing import Any

from minisgl_backend import (
    ConfigError,
    Engine,
    EngineConfig,
    EngineDeadError,
    MiniSGLError,
    RequestOutput,
    SamplingParams,
)
from minisgl_backend.cluster import connect, import_ray, replica_resources

log = logging.getLogger("lm_eval_minisgl")

_COLLECT_WAIT_S = 1.0  # a replica's collect call returns after at most this long (plus a short batch)
_COLLECT_BATCH_S = 0.05  # after the first finished request, gather the others finished meanwhile
DEFAULT_TIMEOUT_S = 120.0  # a replica silent this long (no answer to collect) is declared hung
START_TIMEOUT_S = 900.0  # replicas must have loaded their engine by then (or Ray could not place them)


class ReplicaFailedError(EngineDeadError):
    """A data-parallel replica died, hung or lost its engine; `replica` is its index, the cause chained."""

    def __init__(self, replica: int, message: str) -> None:
        super().__init__(f"data-parallel replica {replica}: {message}")
        self.replica = replica


def _import_ray():
    return import_ray("data_parallel_size > 1")


# ------------------------------------------------------------------------------------------ routing
def prefix_groups(
    prompts: Sequence[Sequence[int]], weights: Sequence[float], block_size: int, cap: float
) -> list[list[int]]:
    """Indices grouped by a shared prefix: first by their first `block_size` tokens; a group heavier
    than `cap` is split again by twice as many tokens, until it fits or its prompts cannot be told
    apart. Groups come out in order of their first index, members in input order."""
    groups: list[list[int]] = []
    todo: list[tuple[list[int], int]] = [(list(range(len(prompts))), block_size)]
    while todo:
        members, k = todo.pop()
        buckets: dict[tuple[int, ...], list[int]] = {}
        for i in members:
            buckets.setdefault(tuple(prompts[i][:k]), []).append(i)
        for bucket in buckets.values():
            heavy = sum(weights[i] for i in bucket) > cap
            if heavy and len(bucket) > 1 and any(len(prompts[i]) > k for i in bucket):
                todo.append((bucket, 2 * k))
            else:
                groups.append(bucket)
    return sorted(groups, key=lambda g: g[0])


def route(
    prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams], n: int, block_size: int
) -> list[list[int]]:
    """Split request indices over `n` replicas: prefix groups (see `prefix_groups`), placed largest
    first on the least loaded replica (weight: prompt tokens + generation budget). Each replica's
    indices are in input order."""
    weights = [len(p) + sp.max_tokens for p, sp in zip(prompts, params)]
    groups = prefix_groups(prompts, weights, block_size, cap=sum(weights) / n)
    loads = [(0.0, r) for r in range(n)]
    shares: list[list[int]] = [[] for _ in range(n)]
    for group in sorted(groups, key=lambda g: (-sum(weights[i] for i in g), g[0])):
        load, r = heapq.heappop(loads)
        shares[r].extend(group)
        heapq.heappush(loads, (load + sum(weights[i] for i in group), r))
    return [sorted(s) for s in shares]


# ------------------------------------------------------------------------------------------ the actor
class EngineReplica:
    """One replica: an Engine loaded once in its own Ray actor process. Requests are submitted all at
    once (`start`, continuous batching over the whole share) and fetched as they finish (`collect`)."""

    def __init__(self, config: dict[str, Any], index: int) -> None:
        self.index = index
        self.engine = Engine(EngineConfig.from_dict(config))
        self._jobs: dict[int, tuple[list, queue.SimpleQueue]] = {}

    def info(self) -> dict[str, Any]:
        import torch

        return {
            "max_model_len": self.engine.max_model_len,
            "num_blocks": self.engine.num_blocks,
            "model_dir": str(self.engine.model_dir),
            "pid": os.getpid(),
            "num_threads": torch.get_num_threads(),
        }

    def start(self, job: int, prompts: list[list[int]], params: list[SamplingParams]) -> int:
        done: queue.SimpleQueue = queue.SimpleQueue()
        handles: list = []
        try:
            for i, (prompt, sp) in enumerate(zip(prompts, params)):
                handle = self.engine.submit(prompt, sp)
                handle.add_done_callback(lambda _h, i=i: done.put(i))
                handles.append(handle)
        except BaseException:
            for handle in handles:
                self.engine.abort(handle.request_id)
            raise
        self._jobs[job] = (handles, done)
        return len(handles)

    def collect(self, job: int, wait_s: float = _COLLECT_WAIT_S) -> list[tuple[int, RequestOutput]]:
        """Requests of `job` finished since the last call (index in the share, output); waits up to
        `wait_s` for the first. Raises the engine's error when it died."""
        handles, done = self._jobs[job]
        try:
            finished = [done.get(timeout=wait_s)]
        except queue.Empty:
            if not self.engine.is_alive:
                raise self.engine.dead or EngineDeadError("the replica's engine stopped") from None
            return []
        deadline = time.monotonic() + _COLLECT_BATCH_S
        while len(finished) < len(handles):
            try:
                finished.append(done.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                break
        return [(i, handles[i].result()) for i in finished]

    def cancel(self, job: int) -> None:
        handles, _ = self._jobs.pop(job, ([], None))
        for handle in handles:
            if not handle.done():
                self.engine.abort(handle.request_id)

    def finish(self, job: int) -> None:
        self._jobs.pop(job, None)

    def metrics(self) -> dict[str, float]:
        return self.engine.metrics()

    def close(self) -> None:
        self.engine.close()


# ------------------------------------------------------------------------------------------ the set
class ReplicaSet:
    """N EngineReplica actors behind the Engine interface the lm-eval adapter uses."""

    def __init__(
        self,
        config: EngineConfig,
        n: int,
        address: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        start_timeout_s: float = START_TIMEOUT_S,
    ) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"data_parallel_size must be an integer >= 1, got {n!r}")
        ray = self._ray = _import_ray()
        self.timeout_s = float(timeout_s)
        self._owns_ray = False
        self._closed = False
        self._failed: ReplicaFailedError | None = None
        self._jobs = itertools.count()
        self.actors: list = []
        self._owns_ray = connect(ray, address)
        if not self._owns_ray:
            log.info("data_parallel_size=%d: using the Ray session already initialised", n)
        atexit.register(self.close)
        try:
            self._start(config, n, start_timeout_s)
        except BaseException:
            self.close()
            raise

    def _start(self, config: EngineConfig, n: int, start_timeout_s: float) -> None:
        ray = self._ray
        config, num_cpus, gpus = replica_resources(ray, config, n, "data_parallel_size")
        self.config = config
        self.n = n
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
        from transformers import AutoTokenizer

        from minisgl_backend.model.loader import resolve_model_dir

        self.model_dir = resolve_model_dir(config.model)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        log.info("data_parallel_size=%d: %d Ray replicas ready, %d threads each", n, n, config.num_threads)

    # --------------------------------------------------------------------------------- requests
    def _get(self, r: int, ref):
        ray = self._ray
        try:
            return ray.get(ref, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise self._fail(r, f"no answer for {self.timeout_s:.0f} s (hung?)") from None
        except ray.exceptions.RayActorError as e:
            raise self._fail(r, f"its actor died: {type(e).__name__}: {e}") from e
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None) or e
            if isinstance(cause, EngineDeadError):
                raise self._fail(r, f"its engine stopped: {cause}") from cause
            if isinstance(cause, MiniSGLError):
                raise cause from None  # a bad request: the same typed error as in process
            raise self._fail(r, f"{type(cause).__name__}: {cause}") from cause

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


def make_engine(
    cfg: EngineConfig, data_parallel_size: Any, ray_address: str | None, replica_timeout_s: Any
) -> Engine | ReplicaSet:
    """The adapter's engine: one in-process Engine (data_parallel_size=1, Ray is not imported), or a
    ReplicaSet of `data_parallel_size` Ray actors with the same interface."""
    n = data_parallel_size
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"data_parallel_size must be an integer >= 1, got {n!r}")
    if n == 1:
        if ray_address is not None or replica_timeout_s is not None:
            log.warning("ray_address / replica_timeout_s are used only with data_parallel_size > 1")
        return Engine(cfg)
    timeout = DEFAULT_TIMEOUT_S if replica_timeout_s is None else replica_timeout_s
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ConfigError(f"replica_timeout_s must be a number > 0, got {replica_timeout_s!r}")
    return ReplicaSet(cfg, n, address=None if ray_address is None else str(ray_address), timeout_s=timeout)
