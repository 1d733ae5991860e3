"""The fault-injection harness itself (:mod:`hvdray.testing.faults`): a plan fires once per job for the
rank and epoch it names, :func:`faults.combine` arms several faults that fire independently, and each
:class:`faults.Responder` answers only its own fault. Each worker is a fresh interpreter, as a Ray worker
process is (the plan is read once, from the environment)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hvdray.testing import faults

ROOT = str(Path(__file__).resolve().parents[2])

_WORKER = """
import sys
from hvdray.testing import faults
epoch, _, size = sys.argv[1].partition("/")
faults.set_context(epoch=int(epoch), size=int(size) if size else None, node_id="node-" + sys.argv[2])
for point in sys.argv[3:]:
    faults.reached(point)
print("went on")
"""


def _worker(env: dict[str, str], rank: int, epoch: int, *points: str, size: int | None = None
            ) -> subprocess.CompletedProcess:
    """One worker of rank ``rank`` in membership ``epoch`` (of ``size`` workers) passing ``points``."""
    full = {**os.environ, **env, "HOROVOD_RANK": str(rank),
            "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    membership = str(epoch) if size is None else f"{epoch}/{size}"
    return subprocess.run([sys.executable, "-c", _WORKER, membership, str(rank), *points],
                          env=full, capture_output=True, text=True, timeout=60)


def _fired(directory: Path):
    path = directory / "fired"
    return json.loads(path.read_text()) if path.exists() else None


def test_two_combined_exits_fire_once_each_for_their_own_rank(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    env = faults.combine(faults.plan("step", "exit", str(one), rank=1, min_epoch=2),
                         faults.plan("step", "exit", str(two), rank=2, min_epoch=2))
    assert _worker(env, 1, 1, "step").returncode == 0  # epoch 1 is before min_epoch
    assert _worker(env, 0, 2, "step", "commit").stdout.strip() == "went on"  # rank 0 is not named
    assert _fired(one) is None and _fired(two) is None
    first = _worker(env, 1, 2, "commit", "step")
    assert first.returncode == 1 and "went on" not in first.stdout
    assert (_fired(one)["rank"], _fired(one)["point"], _fired(one)["epoch"]) == (1, "step", 2) and _fired(two) is None
    second = _worker(env, 2, 3, "step")
    assert second.returncode == 1 and (_fired(two)["rank"], _fired(two)["epoch"]) == (2, 3)
    # both fired: once per job each, so a restarted rank 1 or 2 goes on
    assert _worker(env, 1, 4, "step").returncode == 0 and _worker(env, 2, 4, "step").returncode == 0


def test_a_blocking_fault_and_an_exit_at_the_same_point_both_act(tmp_path):
    exit_dir, join_dir = tmp_path / "exit", tmp_path / "join"
    exit_dir.mkdir(), join_dir.mkdir()
    (join_dir / "released").touch()  # the test side has answered already: the blocked worker goes on at once
    env = faults.combine(faults.plan("sync", "join", str(join_dir), rank=1, min_epoch=1),
                         faults.plan("sync", "exit", str(exit_dir), rank=1, min_epoch=1))
    done = _worker(env, 1, 1, "sync")
    assert done.returncode == 1  # released from the join, then the exit
    assert _fired(join_dir)["action"] == "join" and _fired(exit_dir)["action"] == "exit"
    assert _fired(join_dir)["node_id"] == "node-1" and _fired(join_dir)["dir"] == str(join_dir)


def test_a_chained_fault_fires_only_after_the_one_before_in_a_later_epoch_of_its_size(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    env = faults.combine(faults.plan("step", "exit", str(first), rank=1, size=3),
                         faults.plan("step", "exit", str(second), rank=1, size=3, after=str(first)))
    assert _worker(env, 1, 1, "step", size=2).returncode == 0  # an epoch of two workers: neither is armed
    assert _fired(first) is None and _fired(second) is None
    assert _worker(env, 1, 2, "step", size=3).returncode == 1  # the first fires; the second waited for it
    assert (_fired(first)["epoch"], _fired(first)["size"]) == (2, 3) and _fired(second) is None
    assert _worker(env, 1, 2, "step", size=3).returncode == 0  # the epoch the first fired in: not yet
    assert _worker(env, 1, 3, "step", size=2).returncode == 0  # a later epoch, but of two workers
    assert _worker(env, 1, 3, "step", size=3).returncode == 1
    assert (_fired(second)["epoch"], _fired(second)["size"], _fired(second)["point"]) == (3, 3, "step")


def _ended_process() -> int:
    """The pid of a process that has ended (and been reaped)."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


def test_each_responder_answers_only_its_own_fault(tmp_path):
    acted = []
    mine = faults.Responder(str(tmp_path), lambda node: acted.append(("remove", node)), lambda: acted.append("add"))
    other = {"event": faults.EVENT, "action": "remove_node", "node_id": "n2", "dir": str(tmp_path / "other"),
             "pid": _ended_process()}
    mine(other)
    mine({"event": "elastic", "state": "running"})
    assert acted == [] and not (tmp_path / "released").exists()
    mine({**other, "dir": str(tmp_path)})
    assert acted == [("remove", "n2")] and (tmp_path / "released").exists()


def test_a_removed_nodes_worker_is_released_only_once_its_process_has_ended(tmp_path):
    """Released while alive, the blocked worker would go on (and might return its result) before it
    notices that its raylet is gone; the responder waits for its process to end, zombie included."""
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    seen_alive = []

    def remove_node(node_id: str) -> None:  # the node's processes end a moment after it is removed
        seen_alive.append(worker.poll() is None)
        threading.Timer(0.5, worker.kill).start()  # not reaped: a zombie until the test waits for it

    responder = faults.Responder(str(tmp_path), remove_node, lambda: None)
    started = time.monotonic()
    try:
        responder({"event": faults.EVENT, "action": "remove_node", "node_id": "n1", "dir": str(tmp_path),
                   "pid": worker.pid})
        waited = time.monotonic() - started
    finally:
        worker.kill()
        worker.wait()
    assert seen_alive == [True] and (tmp_path / "released").exists()
    assert 0.4 < waited < 10, waited


def test_bad_plans_are_refused_naming_the_argument(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(ValueError, match="size must be a number of workers"):
        faults.plan("step", "exit", str(tmp_path), size=0)
    with pytest.raises(ValueError, match="after must be another fault's existing directory"):
        faults.plan("step", "exit", str(tmp_path), after=str(tmp_path))
    with pytest.raises(ValueError, match="after must be another fault's existing directory"):
        faults.plan("step", "exit", str(tmp_path), after=str(tmp_path / "missing"))
    assert '"after": "%s"' % other in faults.plan("step", "exit", str(tmp_path), after=str(other))[faults.ENV]


def test_bad_combinations_are_refused_naming_the_argument(tmp_path):
    plan = faults.plan("step", "exit", str(tmp_path))
    with pytest.raises(ValueError, match="plans must be at least two plans"):
        faults.combine(plan)
    with pytest.raises(ValueError, match="plans must each have a directory of their own"):
        faults.combine(plan, faults.plan("commit", "exit", str(tmp_path), rank=2))
    with pytest.raises(TypeError, match=r"plans\[1\] must be the dict plan\(\) returns"):
        faults.combine(plan, {"point": "step"})
