"""The node probe without a cluster: which nodes it calls down, that it asks every node at once, and
that its caller never waits for an answer.

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


class _FakeNodes:
    """``down_nodes`` answering after ``delay_s``: ``gone`` is down, any other node up."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.calls: list[set[str]] = []

    def __call__(self, node_ids):
        self.calls.append(set(node_ids))
        time.sleep(self.delay_s)
        return {n for n in node_ids if n == "gone"}


def _once_answered(probe: NodeProbe, node_ids: list, expected: set, timeout_s: float = 5.0) -> float:
    """Seconds until the probe says ``expected``, asking every 10 ms as a control loop would."""
    started = time.monotonic()
    while probe.down(node_ids) != expected:
        assert time.monotonic() - started < timeout_s, probe.down(node_ids)
        time.sleep(0.01)
    return time.monotonic() - started


def test_the_caller_never_waits_for_an_answer(monkeypatch):
    fake = _FakeNodes(delay_s=1.0)  # a connect timeout, or a starved cluster under Ray Client
    monkeypatch.setattr(node_liveness, "down_nodes", fake)
    probe = NodeProbe(interval_s=60)
    for _ in range(20):
        started = time.monotonic()
        assert probe.down(["up", "gone", None]) <= {"gone", None}
        assert time.monotonic() - started < 0.1, "the caller waited for the probe's question"
        time.sleep(0.01)
    assert fake.calls == [{"up", "gone"}], "one question at a time"
    assert _once_answered(probe, ["up", "gone", None], {"gone", None}) < 1.5


def test_a_node_found_up_is_not_asked_again_within_the_interval_and_one_found_down_never(monkeypatch):
    fake = _FakeNodes()
    monkeypatch.setattr(node_liveness, "down_nodes", fake)
    probe = NodeProbe(interval_s=60)
    _once_answered(probe, ["up", "gone", None], {"gone", None})
    for _ in range(5):
        assert probe.down(["up", "gone"]) == {"gone"}
    assert fake.calls == [{"up", "gone"}]
    _once_answered(probe, ["other", "gone"], {"gone"})
    time.sleep(0.1)
    assert probe.down(["other"]) == set()
    assert fake.calls == [{"up", "gone"}, {"other"}]


def test_an_unreadable_node_table_calls_no_node_down(monkeypatch):
    def broken(node_ids):
        raise ConnectionError("GCS unreachable")

    monkeypatch.setattr(node_liveness, "down_nodes", broken)
    probe = NodeProbe(interval_s=0.0)
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        assert probe.down(["a", "b"]) == set()
        time.sleep(0.01)
