"""The node probe without a cluster: which nodes it calls down, and that it asks every node at once.

The real thing (a killed raylet found down, a frozen worker on a live node waited for) is in
``multinode/test_node_liveness.py``; here Ray's node table and the connection attempt are stand-ins,
because a host that takes a whole connect timeout to fail cannot be made on this machine."""

from __future__ import annotations

import threading
import time

import ray

from hvdray.driver import node_liveness
from hvdray.driver.node_liveness import NodeProbe, down_nodes

SLOW_S = 0.5


def _table(*ports: int, dead: tuple[int, ...] = ()) -> list[dict]:
    return [{"NodeID": f"n{p}", "Alive": p not in dead, "NodeManagerAddress": "127.0.0.1", "NodeManagerPort": p}
            for p in ports]


def test_unreachable_nodes_are_asked_at_once_and_dead_or_unknown_ones_are_down(monkeypatch):
    asked_on: set[str] = set()

    def slow_accepts(address):  # a host that answers (even port) or fails (odd) only after SLOW_S
        asked_on.add(threading.current_thread().name)
        time.sleep(SLOW_S)
        return address[1] % 2 == 0

    monkeypatch.setattr(ray, "nodes", lambda: _table(1, 2, 3, 4, 5, 6, 7, dead=(7,)))
    monkeypatch.setattr(node_liveness, "_accepts", slow_accepts)
    started = time.monotonic()
    found = down_nodes(["n1", "n2", "n3", "n4", "n5", "n7", "n9"])
    took = time.monotonic() - started
    assert found == {"n1", "n3", "n5", "n7", "n9"}
    assert took < 3 * SLOW_S, f"5 slow nodes took {took:.2f} s: asked one after another"
    assert len(asked_on) > 1


def test_a_node_found_up_is_not_asked_again_within_the_interval(monkeypatch):
    calls: list[set[str]] = []

    def fake_down_nodes(node_ids):
        calls.append(set(node_ids))
        return {n for n in node_ids if n == "gone"}

    monkeypatch.setattr(node_liveness, "down_nodes", fake_down_nodes)
    probe = NodeProbe(interval_s=60)
    assert probe.down(["up", "gone", None]) == {"gone", None}
    assert probe.down(["up", "gone"]) == {"gone"}
    assert calls == [{"up", "gone"}, {"gone"}]
