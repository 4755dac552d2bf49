"""Engine replicas on Ray, the one core of lm-eval's `data_parallel_size=N` and `minisgl serve
--replicas N`: the session (`session`: importing Ray, joining or starting a loopback-only cluster),
placement (`placement`: each replica's share of cores and GPUs), prefix-affinity routing (`routing`),
the replica actor wrapping an Engine (`replica`) and a set of plain actors behind the Engine's batch
interface (`replica_set`). The front ends keep only what differs: Ray Serve deployments and HTTP
streaming (serve/ray_app.py, ray_ingress.py, ray_replica.py), lm-eval's model arguments
(adapters/lm_eval_minisgl/replicas.py).

Nothing here imports Ray at import time.
"""

from minisgl_backend.cluster.placement import replica_resources
from minisgl_backend.cluster.replica import EngineReplica, ReplicaFailedError, unwrap_failure
from minisgl_backend.cluster.replica_set import ReplicaSet
from minisgl_backend.cluster.routing import PrefixRouter, prefix_groups, route
from minisgl_backend.cluster.session import (
    connect,
    import_ray,
    import_serve,
    loopback_only,
    serve_grpc_on_loopback,
)

__all__ = [
    "EngineReplica",
    "PrefixRouter",
    "ReplicaFailedError",
    "ReplicaSet",
    "connect",
    "import_ray",
    "import_serve",
    "loopback_only",
    "prefix_groups",
    "replica_resources",
    "route",
    "serve_grpc_on_loopback",
    "unwrap_failure",
]
