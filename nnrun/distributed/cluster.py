"""Ray plumbing for the executors: connect to a cluster, and start engine actors with Ray's fault tolerance.

An engine of N tensor-parallel ranks is one actor that holds N devices (N GPUs, or N times
`cpus_per_engine` CPU slots) and spawns its ranks on its node: Ray decides which node each
engine goes to, and an actor's resources always come from one node, so a group never spans
nodes. That is deliberate: the ranks all-reduce twice per layer, which wants a node's own links
(NVLink, or loopback for CPU ranks), and it keeps the rendezvous on the node's loopback.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RayExecutor:
    """How to spread a job over Ray: how many engines, where, and how faults are retried (by Ray)."""

    num_engines: int = 1
    address: str | None = None  # None: the connected cluster, else $RAY_ADDRESS, else a new local one
    verbose: bool = False  # a progress line per engine
    cpus_per_engine: int = 1  # CPU engines: Ray CPU slots and torch threads per rank (they shape CPU float results)
    max_restarts: int = 3  # Ray restarts a dead engine (a killed worker, a lost node) this many times
    max_task_retries: int = 3  # and re-runs the range it was running
    max_ranges_ahead: int | None = None  # ranges planned but not committed; None: 2 per engine
    on_engines: Callable[[list[Any]], None] | None = None  # called with the actor handles once started (monitoring)
    poll_interval_s: float = 0.5  # how often the driver asks a busy engine for its forward counts (progress bars)

    def __post_init__(self) -> None:
        for name in ("num_engines", "cpus_per_engine"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("max_restarts", "max_task_retries"):
            if getattr(self, name) < -1:
                raise ValueError(f"{name} must be -1 (no limit) or more, got {getattr(self, name)}")
        if self.poll_interval_s <= 0:
            raise ValueError(f"poll_interval_s must be positive, got {self.poll_interval_s}")
        if self.max_ranges_ahead is not None and self.max_ranges_ahead < self.num_engines:
            raise ValueError(
                f"max_ranges_ahead must be at least num_engines ({self.num_engines}), got {self.max_ranges_ahead}"
            )

    @property
    def window(self) -> int:
        return self.max_ranges_ahead if self.max_ranges_ahead is not None else 2 * self.num_engines


def connect(address: str | None) -> bool:
    """Join a Ray cluster unless this process already has; True when this call connected (and should leave)."""
    import ray

    if ray.is_initialized():
        return False
    if address is None and not os.environ.get("RAY_ADDRESS"):
        ray.init(include_dashboard=False, logging_level="WARNING")  # a local cluster, gone when we leave
    else:
        ray.init(address=address, logging_level="WARNING")
    return True


def uses_gpus(llm_kwargs: dict[str, Any]) -> bool:
    """Whether each engine should hold a GPU: the cluster has some and the job did not ask for the CPU."""
    import ray

    device = str(llm_kwargs.get("device") or "auto")
    return device != "cpu" and ray.cluster_resources().get("GPU", 0) > 0


def engine_resources(executor: RayExecutor, has_gpus: bool, tensor_parallel_size: int) -> dict[str, int]:
    """What one engine actor holds: a GPU per rank, or `cpus_per_engine` CPU slots per rank."""
    if has_gpus:
        return {"num_gpus": tensor_parallel_size, "num_cpus": 1}
    return {"num_cpus": executor.cpus_per_engine * tensor_parallel_size}


def check_a_node_fits(resources: dict[str, int], tensor_parallel_size: int) -> None:
    """Refuse an engine that no node of the cluster can hold (Ray would leave it pending forever)."""
    import ray

    names = {"num_gpus": "GPU", "num_cpus": "CPU"}
    nodes = [node["Resources"] for node in ray.nodes() if node["Alive"]]
    for key, amount in resources.items():
        largest = max((node.get(names[key], 0) for node in nodes), default=0)
        if largest < amount:
            raise ValueError(
                f"an engine of tensor_parallel_size={tensor_parallel_size} holds {amount} {names[key]} on one "
                f"node (its ranks share a node), and the largest node of the Ray cluster has {largest:g}: "
                "lower tensor_parallel_size (or cpus_per_engine), or add a larger node"
            )


def start_engines(
    engine_class: type, spec: Any, executor: RayExecutor, has_gpus: bool, tensor_parallel_size: int = 1
) -> list[Any]:
    """`executor.num_engines` actors of `engine_class(spec)`, each holding `engine_resources` on one node."""
    import ray

    resources = engine_resources(executor, has_gpus, tensor_parallel_size)
    check_a_node_fits(resources, tensor_parallel_size)
    actor_class = ray.remote(concurrency_groups={"control": 1})(engine_class).options(
        max_restarts=executor.max_restarts, max_task_retries=executor.max_task_retries, **resources
    )
    return [actor_class.remote(spec) for _ in range(executor.num_engines)]
