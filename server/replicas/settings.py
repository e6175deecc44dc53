"""The replica settings of ``pagedserve serve --num-replicas N`` (the engine's and the server's are
``EngineArgs`` and ``ServerArgs``).

Flags only, not keys of the ``--config`` file: that file holds one server's settings, and the Ray Serve
config (``configs/ray/serve.yaml``) takes these as its application's ``args``. This module imports no
ray, so that the CLI can build its parser without the ``ray`` extra.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pagedserve.engine.config import setting

#: ``--request-router`` choices (``pagedserve.server.replicas.router``); pow2 is Ray Serve's default policy, without its
#: locality preferences.
REQUEST_ROUTERS = ("prefix", "round_robin", "pow2")


@dataclass
class ReplicaSettings:
    """How many engine replicas run on Ray Serve and how requests are routed among them."""

    num_replicas: int = setting(
        1, "Engine replicas on Ray Serve, each a whole engine behind the same OpenAI routes; 1 = the plain "
        "server, without Ray (needs the ray extra above 1)", "replicas")
    request_router: str = setting(
        "prefix", "How requests are spread over the replicas: prefix = to the replica that served the "
        "longest prefix of the prompt unless it is busy (prefix-cache affinity), round_robin = in turn, "
        "pow2 = the shorter queue of two random replicas (Ray Serve's default policy, without its locality)",
        choices=REQUEST_ROUTERS)
    router_imbalance_threshold: int = setting(
        8, "With the prefix router, a replica holding the prefix is passed over for the least-loaded one "
        "when it has more than this many requests in flight beyond it", "requests")
    max_ongoing_requests: int = setting(
        256, "Requests in flight per replica before Ray Serve queues the next ones (its backpressure; the "
        "engine's own waiting queue is behind it)", "requests")
    replica_num_cpus: float = setting(
        1.0, "Ray CPUs reserved per replica; Ray also sets the replica's torch threads (OMP_NUM_THREADS) to "
        "it, unless the environment sets them", "cpus")
    replica_num_gpus: float = setting(
        0.0, "Ray GPUs reserved per replica; 0 = one per tensor-parallel rank when device is cuda, or auto on a "
        "machine with CUDA", "gpus")
    health_check_period_s: float = setting(
        5.0, "How often Ray Serve asks each replica whether its engine runs; a failed check replaces the "
        "replica", "seconds")

    def __post_init__(self) -> None:
        if self.request_router not in REQUEST_ROUTERS:
            raise ValueError(f"request_router must be one of {REQUEST_ROUTERS}, got {self.request_router!r}")
        for name in ("num_replicas", "max_ongoing_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("router_imbalance_threshold", "replica_num_cpus", "replica_num_gpus"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.health_check_period_s <= 0:
            raise ValueError(f"health_check_period_s must be > 0, got {self.health_check_period_s}")


REPLICA_FIELDS = frozenset(f.name for f in dataclasses.fields(ReplicaSettings))
