"""Whether the Ray node of a silent worker is down, asked of the node itself.

A worker whose liveness ping goes unanswered is either gone (its node died, was removed, or cannot be
reached) or only slow (its process starved of CPU, or C code holding the GIL). The ping cannot tell
which, and Ray's node table says a node died only after its health checks (tens of seconds). The
node's raylet can: its port is answered by the node's kernel however busy the node's processes are,
so a connection refused (the raylet is gone, and its workers with it) or not answered within
``_CONNECT_TIMEOUT_S`` (the host is gone or cut off) means down, and a connection taken means the node
is up and the worker only slow.

Under Ray Client the driver runs outside the cluster and may not reach the raylets' ports: the
question is then asked by a zero-CPU task on the cluster, and a node it cannot answer for in time is
not called down (a starved cluster is slow, not gone).
"""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Optional

import ray
import ray.util.client

_CONNECT_TIMEOUT_S = 1.0  # a raylet's host that takes longer than this to accept a connection is gone
_ON_CLUSTER_TIMEOUT_S = 10.0  # how long a Ray Client driver waits for the cluster to answer for its nodes


def down_nodes(node_ids: Iterable[str]) -> set[str]:
    """Those of ``node_ids`` that are down: not alive in Ray's node table, or their raylet's port does
    not accept a connection. Under Ray Client, asked on the cluster (empty if it does not answer)."""
    wanted = set(node_ids)
    if not wanted:
        return set()
    if ray.util.client.ray.is_connected():
        try:
            return set(ray.get(_down_nodes_on_cluster.options(num_cpus=0).remote(sorted(wanted)),
                               timeout=_ON_CLUSTER_TIMEOUT_S))
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayError):
            return set()
    raylets = {node["NodeID"]: (node["NodeManagerAddress"], int(node["NodeManagerPort"]))
               for node in ray.nodes() if node.get("Alive")}
    asked = sorted(wanted & raylets.keys())
    if len(asked) > 1:  # all at once: several unreachable hosts cost one connect timeout, not one each
        with ThreadPoolExecutor(max_workers=min(len(asked), 32), thread_name_prefix="hvdray-node-probe") as pool:
            accepted = dict(zip(asked, pool.map(_accepts, [raylets[n] for n in asked])))
    else:
        accepted = {n: _accepts(raylets[n]) for n in asked}
    return {node_id for node_id in wanted if not accepted.get(node_id, False)}


def _accepts(address: tuple[str, int]) -> bool:
    try:
        with socket.create_connection(address, timeout=_CONNECT_TIMEOUT_S):
            return True
    except OSError:  # refused, unreachable or timed out
        return False


@ray.remote
def _down_nodes_on_cluster(node_ids: list[str]) -> list[str]:
    return sorted(down_nodes(node_ids))


class NodeProbe:
    """Asks :func:`down_nodes` about each node at most once per ``interval_s`` (a node found up stays up
    for that long), so that a control loop ticking every few milliseconds can ask on every tick."""

    def __init__(self, interval_s: float) -> None:
        self._interval_s = interval_s
        self._up_until: dict[str, float] = {}  # node id -> until when it counts as up

    def down(self, node_ids: Iterable[Optional[str]]) -> set[Optional[str]]:
        """Those of ``node_ids`` found down (an unknown node, None, counts as down)."""
        now = time.monotonic()
        wanted = set(node_ids)
        due = {n for n in wanted if n is not None and self._up_until.get(n, 0.0) <= now}
        found = down_nodes(due) if due else set()
        for node_id in due - found:
            self._up_until[node_id] = now + self._interval_s
        return found | ({None} & wanted)
