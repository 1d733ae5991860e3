"""Resource arithmetic and the job's placement group. CPUs, GPUs and bundles are computed here only."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import ray
import ray.util.client
from ray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

log = logging.getLogger(__name__)

#: Test-only: called with the placement group right after the cluster granted it, before any worker
#: starts (the multi-node tests remove a node here, to hit that window every time).
after_ready_hook: Optional[Callable[[PlacementGroup], None]] = None


class PlacementInfeasibleError(TimeoutError):
    """The cluster can never grant the workers' placement group as it is now: a bundle fits no node,
    the bundles together exceed what the nodes hold, or STRICT_SPREAD asks for more nodes than there
    are. A ``TimeoutError`` (what horovod.ray users catch), raised at once instead of after the timeout."""


@dataclass(frozen=True)
class NodeResources:
    """One alive Ray node: its id, address, total resources and those free now."""

    node_id: str
    address: str
    total: dict[str, float]
    free: dict[str, float]


def cluster_nodes() -> list[NodeResources]:
    """The alive Ray nodes (each raylet is one, also several on one host), from Ray's node table."""
    free_by_node = _available_per_node()
    return [
        NodeResources(node["NodeID"], node.get("NodeManagerAddress", "?"), dict(node.get("Resources", {})),
                      free_by_node.get(node["NodeID"], {}))
        for node in ray.nodes() if node.get("Alive")
    ]


def _available_per_node() -> dict[str, dict[str, float]]:
    """Free resources per node id (Ray's state helper; empty if it is unavailable: totals still show).

    Not ``ray.util.state.list_nodes``: its ``NodeState`` has no free resources, it needs the dashboard
    (``init_ray`` starts Ray without one), and it takes about 40 ms a call against 0.3 ms for the GCS
    reads here, which run every second while a fixed start waits for its bundles."""
    try:
        return free_resources_per_node()
    except Exception:  # noqa: BLE001 - a private helper of Ray's: the free column is a courtesy
        return {}


def free_resources_per_node() -> dict[str, dict[str, float]]:
    """Free resources per Ray node id, from the GCS. Under Ray Client (``ray.init("ray://...")``) this
    process has no GCS connection of its own, so the question is asked by a zero-CPU task on the cluster."""
    if ray.util.client.ray.is_connected():
        return ray.get(_free_resources_on_cluster.options(num_cpus=0).remote())
    from ray._private.state import available_resources_per_node  # Ray's per-node free resources

    return {node_id: dict(free) for node_id, free in available_resources_per_node().items()}


@ray.remote
def _free_resources_on_cluster() -> dict[str, dict[str, float]]:
    return free_resources_per_node()


def _fits(node: dict[str, float], bundle: dict[str, float]) -> int:
    """How many copies of ``bundle`` fit in ``node``'s resources."""
    counts = [math.floor(node.get(k, 0.0) / v + 1e-9) for k, v in bundle.items() if v > 0]
    return min(counts) if counts else 1 << 30


def infeasibility(bundles: Sequence[dict[str, float]], strategy: str, nodes: Sequence[NodeResources]) -> Optional[str]:
    """Why ``bundles`` under ``strategy`` can never be placed on ``nodes``' total resources, or None
    if they can (exact for bundles that are all alike, as the executor's are; otherwise only what
    must hold for any layout is checked)."""
    totals = [n.total for n in nodes]
    for bundle in bundles:
        if not any(_fits(t, bundle) for t in totals):
            return f"no node has {bundle} for one bundle"
    if strategy == "STRICT_SPREAD":
        fitting = sum(1 for t in totals if all(_fits(t, b) for b in bundles))
        if fitting < len(bundles):
            return f"STRICT_SPREAD needs {len(bundles)} distinct nodes that each fit a bundle, and {fitting} do"
    if strategy == "STRICT_PACK":
        whole = {k: sum(b.get(k, 0.0) for b in bundles) for b in bundles for k in b}
        if not any(_fits(t, whole) for t in totals):
            return f"STRICT_PACK needs one node with {whole}, and none has it"
    if all(b == bundles[0] for b in bundles):
        room = sum(_fits(t, bundles[0]) for t in totals)
        if room < len(bundles):
            return f"the nodes hold {room} bundle(s) of {bundles[0]} at most, {len(bundles)} are asked for"
    else:
        for key in {k for b in bundles for k in b}:
            asked, held = sum(b.get(key, 0.0) for b in bundles), sum(t.get(key, 0.0) for t in totals)
            if asked > held + 1e-9:
                return f"the bundles need {asked:g} {key} and the nodes hold {held:g}"
    return None


def describe_nodes(nodes: Sequence[NodeResources], keys: Sequence[str]) -> str:
    """One line per Ray node, by node id: total and free amounts of ``keys``."""
    if not nodes:
        return "  (no alive Ray node)"
    lines = []
    for node in nodes:
        amounts = ", ".join(f"{k} {node.total.get(k, 0.0):g} total / {node.free.get(k, 0.0):g} free" for k in keys)
        lines.append(f"  node {node.node_id} ({node.address}): {amounts}")
    return "\n".join(lines)


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

    def __init__(self, plan: PlacementPlan, timeout_s: float, use_current_placement_group: bool, name: str = "") -> None:
        """``name``: what ``ray list placement-groups`` and the dashboard call a group created here."""
        self.plan = plan
        current = get_current_placement_group() if use_current_placement_group else None
        self._owned = current is None
        self.group: PlacementGroup = current if current is not None else placement_group(
            plan.bundles, strategy=plan.strategy, name=name
        )
        if self._owned:
            try:
                self._wait_until_granted(timeout_s)
            except BaseException:
                self.release()  # also after Ctrl-C in the wait: a pending group would hold its place in Ray's queue
                raise

    def _wait_until_granted(self, timeout_s: float) -> None:
        self.check_feasible()
        ready, _ = ray.wait([self.group.ready()], timeout=timeout_s)
        if not ready:
            raise TimeoutError(
                f"the cluster did not grant {self.plan.describe()} for {self.plan.num_workers} worker(s) within "
                f"placement_group_timeout_s={timeout_s} s (it could, once other jobs free their resources); "
                f"per Ray node:\n{describe_nodes(cluster_nodes(), self._keys())}"
            )
        if after_ready_hook is not None:
            after_ready_hook(self.group)

    def _keys(self) -> list[str]:
        return sorted({k for b in self.plan.bundles for k in b} | {"CPU"})

    def check_feasible(self) -> None:
        """Raise :class:`PlacementInfeasibleError` (and release the group) if the alive nodes can never
        hold the group: at the start, and while workers start (a node may have died meanwhile)."""
        if not self._owned or self.group is None:
            return
        nodes = cluster_nodes()
        why = infeasibility(self.plan.bundles, self.plan.strategy, nodes)
        if why is None:
            return
        self.release()
        raise PlacementInfeasibleError(
            f"the cluster can never grant {self.plan.describe()} for {self.plan.num_workers} worker(s): {why}. "
            f"Requested per bundle: {self.plan.bundles[0]}; per Ray node (alive now):\n"
            f"{describe_nodes(nodes, self._keys())}\n"
            "Ask for fewer workers or resources per worker, or add nodes (an autoscaling cluster: start "
            "them first; hvdray counts the nodes alive now)."
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
