"""Where an elastic job may run: slots per Ray node, from Ray's cluster state or a user's discovery object."""

from __future__ import annotations

import logging
from typing import Any, Callable, Protocol

import ray

from hvdray.driver.placement import free_resources_per_node, worker_slots

log = logging.getLogger(__name__)


class HostDiscovery(Protocol):
    """Horovod's discovery interface: hosts (Ray node ids, IPs or hostnames) and the job's slots on each."""

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        """Every host the job may use now, with how many workers it may run there in total."""


class RayNodeDiscovery:
    """Slots from Ray itself: each alive node's free resources, plus what this job's workers already hold."""

    def __init__(
        self, cpus_per_worker: float, gpus_per_worker: float, held: Callable[[], dict[str, int]]
    ) -> None:
        self._cpus = cpus_per_worker
        self._gpus = gpus_per_worker
        self._held = held

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        held = self._held()
        slots = {}
        for node_id, free in free_resources_per_node().items():
            if node_id in alive:
                total = worker_slots(free, self._cpus, self._gpus) + held.get(node_id, 0)
                if total:
                    slots[node_id] = total
        return slots


def slots_per_node(discovery: HostDiscovery) -> dict[str, int]:
    """Ask ``discovery`` and key its answer by Ray node id (hosts given by IP or hostname are matched to
    alive nodes; when several raylets share an address, the first one gets the slots)."""
    found = discovery.find_available_hosts_and_slots()
    if not isinstance(found, dict):
        raise TypeError(
            f"find_available_hosts_and_slots() must return a dict of host to slots, got {type(found).__name__}"
        )
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    by_id = {n["NodeID"]: n for n in nodes}
    result: dict[str, int] = {}
    for host, slots in found.items():
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 0:
            raise ValueError(f"discovery gave host {host!r} {slots!r} slots; slots must be an int >= 0")
        node_id = host if host in by_id else _node_of(host, nodes)
        if node_id is None:
            log.debug("discovery named host %r, which is not an alive Ray node; ignored", host)
            continue
        result[node_id] = result.get(node_id, 0) + slots
    return {k: v for k, v in result.items() if v > 0}


def _node_of(host: str, nodes: list[dict[str, Any]]) -> Any:
    for node in nodes:
        if host in (node.get("NodeManagerAddress"), node.get("NodeManagerHostname")):
            return node["NodeID"]
    return None
