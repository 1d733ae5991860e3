"""Resource arithmetic and the job's placement group. CPUs, GPUs and bundles are computed here only."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import ray
from ray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlacementPlan:
    """What the workers need: one bundle per worker (``num_workers``) or per host (``num_hosts``)."""

    num_workers: int
    workers_per_bundle: int
    cpus_per_worker: float
    gpus_per_worker: float
    strategy: str

    @property
    def bundles(self) -> list[dict[str, float]]:
        bundle = {"CPU": self.cpus_per_worker * self.workers_per_bundle}
        if self.gpus_per_worker:
            bundle["GPU"] = self.gpus_per_worker * self.workers_per_bundle
        return [dict(bundle) for _ in range(self.num_workers // self.workers_per_bundle)]

    def bundle_of(self, worker_index: int) -> int:
        return worker_index // self.workers_per_bundle

    def describe(self) -> str:
        bundles = self.bundles
        return f"{len(bundles)} bundle(s) of {bundles[0]} with strategy {self.strategy}"


def plan_placement(
    num_workers: Optional[int],
    num_hosts: Optional[int],
    num_workers_per_host: int,
    cpus_per_worker: float,
    gpus_per_worker: float,
) -> PlacementPlan:
    """``num_workers`` packs workers onto as few nodes as fit; ``num_hosts`` puts exactly
    ``num_workers_per_host`` on each of ``num_hosts`` distinct nodes. Arguments are already validated."""
    if num_hosts is not None:
        return PlacementPlan(
            num_workers=num_hosts * num_workers_per_host,
            workers_per_bundle=num_workers_per_host,
            cpus_per_worker=cpus_per_worker,
            gpus_per_worker=gpus_per_worker,
            strategy="STRICT_SPREAD",
        )
    assert num_workers is not None
    return PlacementPlan(
        num_workers=num_workers,
        workers_per_bundle=1,
        cpus_per_worker=cpus_per_worker,
        gpus_per_worker=gpus_per_worker,
        strategy="PACK",
    )


class Placement:
    """The placement group the workers live in: created and owned here, or the caller's (a Tune trial)."""

    def __init__(self, plan: PlacementPlan, timeout_s: float, use_current_placement_group: bool) -> None:
        self.plan = plan
        current = get_current_placement_group() if use_current_placement_group else None
        self._owned = current is None
        self.group: PlacementGroup = current if current is not None else placement_group(
            plan.bundles, strategy=plan.strategy
        )
        if self._owned:
            ready, _ = ray.wait([self.group.ready()], timeout=timeout_s)
            if not ready:
                self.release()
                raise TimeoutError(
                    f"the cluster did not grant {plan.describe()} for {plan.num_workers} worker(s) within "
                    f"placement_group_timeout_s={timeout_s} s; cluster total: {_resources(ray.cluster_resources())}, "
                    f"free now: {_resources(ray.available_resources())}"
                )

    def actor_options(self, worker_index: int) -> dict[str, Any]:
        """Ray actor options that put worker ``worker_index`` in its bundle with its share of resources."""
        bundle = self.plan.bundle_of(worker_index) if self._owned else -1
        return {
            "num_cpus": self.plan.cpus_per_worker,
            "num_gpus": self.plan.gpus_per_worker,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.group,
                placement_group_bundle_index=bundle,
                placement_group_capture_child_tasks=False,
            ),
        }

    def release(self) -> None:
        """Remove the group if this object created it; a borrowed group stays with its owner."""
        if self._owned and self.group is not None:
            remove_placement_group(self.group)
            self.group = None


def _resources(resources: dict[str, float]) -> str:
    shown = {k: resources[k] for k in ("CPU", "GPU") if k in resources}
    nodes = sum(1 for k in resources if k.startswith("node:") and not k.startswith("node:__internal"))
    return f"{shown} on {nodes} node(s)"


def worker_slots(free: dict[str, float], cpus_per_worker: float, gpus_per_worker: float) -> int:
    """How many more workers of this shape fit in a node's ``free`` resources (elastic discovery)."""
    slots = int(free.get("CPU", 0.0) / cpus_per_worker + 1e-9)
    if gpus_per_worker:
        slots = min(slots, int(free.get("GPU", 0.0) / gpus_per_worker + 1e-9))
    return max(slots, 0)


def node_worker_options(node_id: str, cpus_per_worker: float, gpus_per_worker: float) -> dict[str, Any]:
    """Ray actor options for one elastic worker pinned to ``node_id`` (elastic jobs use no placement group:
    their size changes with the cluster)."""
    return {
        "num_cpus": cpus_per_worker,
        "num_gpus": gpus_per_worker,
        "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False),
    }
