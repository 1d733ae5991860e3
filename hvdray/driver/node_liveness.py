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

import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Optional

import ray
import ray.util.client

log = logging.getLogger(__name__)

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
    """Asks :func:`down_nodes` about nodes on a thread of its own, so that a control loop ticking every
    few milliseconds can ask on every tick and never waits for an answer (a connect timeout, or a Ray
    Client round trip to a starved cluster): :meth:`down` returns what the answers so far say, and starts
    a question about the nodes it was asked for that are due (one question at a time). A node found up
    counts as up for ``interval_s``; a node found down stays down (Ray never revives a node id)."""

    def __init__(self, interval_s: float) -> None:
        self._interval_s = interval_s
        self._up_until: dict[str, float] = {}  # node id -> until when it counts as up
        self._found_down: set[str] = set()
        self._question: Optional[threading.Thread] = None
        self._answer: Optional[tuple[set[str], set[str]]] = None  # (asked, found down), set by the question

    def down(self, node_ids: Iterable[Optional[str]]) -> set[Optional[str]]:
        """Those of ``node_ids`` found down so far (an unknown node, None, counts as down)."""
        wanted = set(node_ids)
        self._take_answer()
        now = time.monotonic()
        due = {n for n in wanted - self._found_down if n is not None and self._up_until.get(n, 0.0) <= now}
        if due and self._question is None:
            self._question = threading.Thread(target=self._ask, args=(due,), name="hvdray-node-probe", daemon=True)
            self._question.start()
        return (self._found_down & wanted) | ({None} & wanted)

    def _ask(self, node_ids: set[str]) -> None:
        try:
            found = down_nodes(node_ids)
        except Exception:  # noqa: BLE001 - Ray's node table unreadable now: no node is called down for it
            log.debug("could not ask whether nodes %s are down", sorted(node_ids), exc_info=True)
            found = set()
        self._answer = (node_ids, found)

    def _take_answer(self) -> None:
        if self._question is None or self._question.is_alive():
            return
        asked, found = self._answer or (set(), set())
        self._question, self._answer = None, None
        self._found_down |= found
        until = time.monotonic() + self._interval_s
        for node_id in asked - found:
            self._up_until[node_id] = until
