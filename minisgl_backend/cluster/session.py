"""The Ray session of the engine replicas: importing Ray (the `ray` extra), joining or starting a
cluster, and keeping every socket of a cluster started here on loopback.

Ray is imported only here and only when replicas are asked for, so a single-engine run never loads it.
"""

from __future__ import annotations

import os
from typing import Any

from minisgl_backend.cluster.placement import local_cpus
from minisgl_backend.errors import MissingExtraError


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


def serve_grpc_on_loopback(feature: str) -> None:
    """On a node whose address is 127.0.0.1 (the loopback-only cluster `connect` starts), make this
    Serve replica's inter-deployment gRPC server listen there too: Ray Serve binds it to `[::]:0`
    whatever the node's address (ray/serve/_private/replica.py). Called from a deployment's
    constructor, which Serve runs before it starts that server; a no-op elsewhere."""
    ray = import_ray(feature)
    from ray.serve._private import replica as serve_replica

    add_port = getattr(serve_replica, "add_port_to_grpc_server", None)
    if add_port is None or getattr(add_port, "loopback", False):
        return
    if ray.util.get_node_ip_address() != "127.0.0.1":
        return

    def loopback_port(server: Any, address: str) -> Any:
        return add_port(
            server, "127.0.0.1:" + address[len("[::]:") :] if address.startswith("[::]:") else address
        )

    loopback_port.loopback = True  # type: ignore[attr-defined]
    serve_replica.add_port_to_grpc_server = loopback_port
