"""Data-parallel replicas: `--model_args ...,data_parallel_size=N` runs N engine replicas on Ray
(minisgl_backend.cluster.ReplicaSet: requests routed by shared prefix, each replica with its share
of the cores); the adapter uses the set as it would the in-process Engine."""

from __future__ import annotations

import logging
from typing import Any

from minisgl_backend import ConfigError, Engine, EngineConfig
from minisgl_backend.cluster import ReplicaSet
from minisgl_backend.cluster.placement import check_count
from minisgl_backend.cluster.replica_set import DEFAULT_TIMEOUT_S

log = logging.getLogger("lm_eval_minisgl")

KNOB = "data_parallel_size"


def make_engine(
    cfg: EngineConfig, data_parallel_size: Any, ray_address: str | None, replica_timeout_s: Any
) -> Engine | ReplicaSet:
    """The adapter's engine: one in-process Engine (data_parallel_size=1, Ray is not imported), or a
    ReplicaSet of `data_parallel_size` Ray actors with the same interface."""
    n = check_count(data_parallel_size, KNOB)
    if n == 1:
        if ray_address is not None or replica_timeout_s is not None:
            log.warning("ray_address / replica_timeout_s are used only with data_parallel_size > 1")
        return Engine(cfg)
    timeout = DEFAULT_TIMEOUT_S if replica_timeout_s is None else replica_timeout_s
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ConfigError(f"replica_timeout_s must be a number > 0, got {replica_timeout_s!r}")
    address = None if ray_address is None else str(ray_address)
    return ReplicaSet(cfg, n, KNOB, address=address, timeout_s=timeout)
