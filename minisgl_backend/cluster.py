"""Ray for engine replicas, shared by lm-eval's `data_parallel_size=N` and `minisgl serve --replicas N`:
importing it (the `ray` extra), joining or starting a cluster, and each replica's share of it.

Ray is imported only here and only when replicas are asked for, so a single-engine run never loads it.
"""

from __future__ import annotations

import os
import time
from typing import Any

from minisgl_backend.config import EngineConfig
from minisgl_backend.errors import ConfigError, MissingExtraError

RESOURCE_WAIT_S = 5.0  # how long to wait for free CPUs/GPUs before saying the replicas do not fit


def import_ray(feature: str) -> Any:
    """`ray`, or MissingExtraError naming the extra; `feature` says what needed it."""
    try:
        import ray
    except ImportError as e:
        raise MissingExtraError(
            f"{feature} runs the replicas on Ray, which is not installed: pip install 'minisgl[ray]'"
        ) from e
    return ray


def import_serve(feature: str) -> Any:
    """`ray.serve` (Ray's serving library needs more packages than Ray itself)."""
    import_ray(feature)
    try:
        from ray import serve
    except ImportError as e:
        raise MissingExtraError(
            f"{feature} needs Ray Serve, which is not fully installed ({e}): pip install 'minisgl[ray]'"
        ) from e
    return serve


def connect(ray: Any, address: str | None) -> bool:
    """Make sure this process is connected to a Ray cluster; returns whether it started the session
    (and so must shut it down). An already initialised session is used as it is. Otherwise `address`
    (or RAY_ADDRESS) joins a running cluster (`auto`, `HOST:PORT`, `ray://...`); without one, or
    with `local`, a cluster of this machine's cores is started (no dashboard)."""
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address and address != "local":
        if address.rsplit(":", 1)[0] in ("127.0.0.1", "localhost"):
            loopback_only(ray)  # a loopback-only cluster (one `connect` started) is joined the same way
        ray.init(address=address, log_to_driver=False)
    else:
        loopback_only(ray)
        ray.init(
            address=address,
            num_cpus=local_cpus(),
            include_dashboard=False,
            log_to_driver=False,
            _node_ip_address="127.0.0.1",
        )
    return True


def loopback_only(ray: Any) -> None:
    """Make the cluster that `connect` starts listen on 127.0.0.1 only. Ray's servers (GCS, raylet,
    workers, agents) bind to loopback only when the node's address is 127.0.0.1, and `ray.init`
    replaces a loopback `_node_ip_address` (or a 127.0.0.1 cluster address) by the machine's
    routable one unless Ray's "no clusters" mode is on (its default on macOS and Windows): switched
    on here, for this process and the Ray processes it starts. Another driver joining such a cluster
    needs it too (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, or this call before `ray.init`)."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


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
    if config.num_threads is None:
        config = config.replace(num_threads=share)
    num_cpus = min(config.num_threads, max(1, int(max_node)))
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
