"""Where the engine replicas run: each replica's share of the cluster's cores and GPUs, checked
against what is free before Ray is asked to place them."""

from __future__ import annotations

import os
import time
from typing import Any

from minisgl_backend.config import EngineConfig
from minisgl_backend.errors import ConfigError

RESOURCE_WAIT_S = 5.0  # how long to wait for free CPUs/GPUs before saying the replicas do not fit


def check_count(n: Any, knob: str) -> int:
    """`n` when it is an integer >= 1; ConfigError naming `knob` otherwise."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"{knob} must be an integer >= 1, got {n!r}")
    return n


def local_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_share(n: int, cluster_cpus: float, max_node_cpus: float) -> int:
    """Threads (and Ray CPUs) per replica: an equal share of the cluster, at most one node's CPUs."""
    return max(1, min(int(cluster_cpus) // n, int(max_node_cpus)))


def replica_resources(ray: Any, config: EngineConfig, n: int, what: str) -> tuple[EngineConfig, int, int]:
    """(the replicas' config, num_cpus, num_gpus of each) for `n` replicas on the connected cluster.
    The config gets `num_threads` = the replica's core share unless it sets one, and `device="cuda"`
    on GPUs (Ray shows each replica its own GPU as cuda:0). Waits up to RESOURCE_WAIT_S for
    just-released resources, then raises ConfigError if the replicas do not fit: Ray would otherwise
    leave them pending forever. `what` names the knob in that message (`data_parallel_size`)."""
    nodes = [nd for nd in ray.nodes() if nd.get("Alive")]
    max_node = max((nd.get("Resources", {}).get("CPU", 0) for nd in nodes), default=1)
    share = cpu_share(n, ray.cluster_resources().get("CPU", 1), max_node)
    threads = share if config.num_threads is None else config.num_threads
    config = config.replace(num_threads=threads)
    num_cpus = min(threads, max(1, int(max_node)))
    gpus = 1 if config.device.startswith("cuda") else 0
    if gpus:
        config = config.replace(device="cuda")
    deadline = time.monotonic() + RESOURCE_WAIT_S
    while True:
        free = ray.available_resources()
        fits = free.get("CPU", 0) >= n * num_cpus and free.get("GPU", 0) >= n * gpus
        if fits or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if not fits:
        raise ConfigError(
            f"{what}={n} needs {n} x (num_cpus={num_cpus}, num_gpus={gpus}) free in the "
            f"Ray cluster, which has {free.get('CPU', 0):g} CPUs and {free.get('GPU', 0):g} GPUs "
            f"free: lower {what} or num_threads, or close the other replicas"
        )
    return config, num_cpus, gpus
