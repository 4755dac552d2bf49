"""One engine replica: an Engine loaded once in its own Ray actor process, and what its callers make
of a failed call to it.

The plain actor (lm-eval's replicas) takes a whole share of requests at once (`start`, continuous
batching over the share) and hands back the finished ones as they come (`collect`); the Serve
replica of `minisgl serve --replicas` subclasses it with a streaming call per request.
"""

from __future__ import annotations

import os
import queue
import time
from typing import Any

from minisgl_backend.config import EngineConfig
from minisgl_backend.engine import Engine
from minisgl_backend.errors import EngineDeadError
from minisgl_backend.handle import RequestHandle
from minisgl_backend.types import RequestOutput, SamplingParams

COLLECT_WAIT_S = 1.0  # a collect call returns after at most this long (plus a short batch)
_COLLECT_BATCH_S = 0.05  # after the first finished request, gather the others finished meanwhile


class ReplicaFailedError(EngineDeadError):
    """An engine replica died, hung or lost its engine; `replica` is its index, the cause chained."""

    def __init__(self, replica: int, message: str) -> None:
        super().__init__(f"engine replica {replica}: {message}")
        self.replica = replica


def unwrap_failure(ray: Any, e: BaseException) -> tuple[BaseException, str | None]:
    """(the error a replica call raised, out of Ray's RayTaskError wrapper; why the replica is out of
    service, or None when only the call failed: a bad request, a cancellation)."""
    exc = ray.exceptions
    cause = getattr(e, "cause", None) if isinstance(e, exc.RayTaskError) else None
    cause = cause if isinstance(cause, BaseException) else e
    if isinstance(cause, EngineDeadError):
        return cause, f"its engine stopped: {cause}"
    if isinstance(cause, exc.RayActorError):
        return cause, f"its actor died: {type(cause).__name__}"
    return cause, None


class EngineReplica:
    """The actor: an Engine built from `config` (EngineConfig.to_dict form) and its share's jobs."""

    def __init__(self, config: dict[str, Any], index: int) -> None:
        self.index = index
        self.engine = Engine(EngineConfig.from_dict(config))
        self._jobs: dict[int, tuple[list[RequestHandle], queue.SimpleQueue[int]]] = {}

    def info(self) -> dict[str, Any]:
        import torch

        return {
            "index": self.index,
            "model_dir": str(self.engine.model_dir),
            "max_model_len": self.engine.max_model_len,
            "vocab_size": self.engine.vocab_size,
            "num_blocks": self.engine.num_blocks,
            "pid": os.getpid(),
            "num_threads": torch.get_num_threads(),
        }

    def health(self) -> int:
        """This replica's process id; raises the engine's error when it no longer runs."""
        if not self.engine.is_alive:
            raise self.engine.dead or EngineDeadError("the engine is not running")
        return os.getpid()

    def metrics(self) -> dict[str, float]:
        return self.engine.metrics()

    # ---------------------------------------------------------------- a share of a batch
    def start(self, job: int, prompts: list[list[int]], params: list[SamplingParams]) -> int:
        done: queue.SimpleQueue[int] = queue.SimpleQueue()
        handles: list[RequestHandle] = []
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

    def collect(self, job: int, wait_s: float = COLLECT_WAIT_S) -> list[tuple[int, RequestOutput]]:
        """Requests of `job` finished since the last call (index in the share, output); waits up to
        `wait_s` for the first. Raises the engine's error when it died."""
        handles, done = self._jobs[job]
        try:
            finished = [done.get(timeout=wait_s)]
        except queue.Empty:
            finished = []
        if not finished:
            self.health()
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
