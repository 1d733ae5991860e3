"""A silent worker is gone only if its node is: a frozen worker on a live node is waited for, a node whose
raylet was killed is called down at once (before Ray's own health checks say so).

The cluster here keeps Ray's default health checks (the other elastic tests shorten them), so that what
finds a lost node fast is hvdray's own probe of the node, not Ray.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import ray
import ray.cloudpickle
from ray.cluster_utils import Cluster

from hvdray.driver.node_liveness import NodeProbe, down_nodes

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import elastic_checks  # noqa: E402
from elastic_checks import (  # noqa: E402
    Recorder, check_invariants, elastic_executor, remove_node_of, train_job, use_nodes, worker_nodes,
)

ray.cloudpickle.register_pickle_by_value(elastic_checks)
pytestmark = pytest.mark.slow

EPOCHS = 4
FROZEN_S = 6.0  # longer than the 2 s a ping may go unanswered, shorter than the collectives' timeout_s=10


@pytest.fixture(scope="module")
def cluster():
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    ray.init(address=cluster.address)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def _alive_in_ray(node_id: str) -> bool:
    return any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes())


def test_a_node_whose_raylet_was_killed_is_down_before_ray_says_so(cluster):
    use_nodes(cluster, 2)
    kept, lost = (n.node_id for n in worker_nodes(cluster))
    assert down_nodes([kept, lost]) == set()
    probe = NodeProbe(interval_s=0.0)
    assert probe.down([kept, lost, None]) == {None}, "a worker with no known node counts as on a node that is down"
    remove_node_of(cluster, lost)  # the raylet is killed, not drained: as a lost machine's would stop
    started = time.monotonic()
    while probe.down([kept, lost]) != {lost} and time.monotonic() - started < 5.0:
        time.sleep(0.01)  # the probe answers on its own thread; a control loop asks on every tick
    assert probe.down([kept, lost]) == {lost}
    assert time.monotonic() - started < 1.0
    # what makes the probe worth having: with its default health checks, Ray still lists the node alive
    assert _alive_in_ray(lost), "Ray noticed the lost node as fast as the probe: the probe may be unneeded"
    assert down_nodes(["f" * 56]) == {"f" * 56}, "a node Ray does not know is down"


def test_a_frozen_worker_on_a_live_node_is_waited_for_not_dropped(cluster, caplog, tmp_path):
    """Rank 1's process is stopped (SIGSTOP: what a worker starved of CPU looks like to its pings) for
    longer than a ping may go unanswered; its node is up, so the job waits and goes on with both ranks.
    The ranks commit in a loop before epoch 2 until the test has let rank 1 go on, so the job cannot
    end before the freeze, however late the commit record that starts it arrives."""
    caplog.set_level(logging.WARNING, logger="hvdray.driver")
    use_nodes(cluster, 2)
    recorder = Recorder()
    frozen: dict[str, float] = {}
    released = tmp_path / "released"

    def freeze(record):
        def stop_then_continue():
            os.kill(record["pid"], signal.SIGSTOP)
            frozen["at"] = time.monotonic()
            time.sleep(FROZEN_S)
            os.kill(record["pid"], signal.SIGCONT)
            frozen["for"] = time.monotonic() - frozen["at"]
            released.touch()

        threading.Thread(target=stop_then_continue, daemon=True).start()

    recorder.on(lambda r: r.get("kind") == "commit" and r["rank"] == 1 and r["epoch"] == 0, freeze)
    with elastic_executor(min_workers=2, max_workers=2) as ex:
        ex.start()
        # hold: before epoch 2, commit until the job has 3 workers (never: at most 2) or ``released`` exists
        results = ex.run(train_job, args=[EPOCHS], kwargs={"hold": (2, 3, 120.0, str(released))},
                         callbacks=[recorder])
    assert frozen.get("for", 0) >= FROZEN_S, frozen
    check_invariants(results, recorder, EPOCHS)
    assert len(results) == 2 and results[0]["sizes"] == [2] * EPOCHS, results[0]["sizes"]
    assert not [t for t in recorder.transitions() if t["state"] == "recovering"], recorder.transitions()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [w for w in warnings if "lost" in w], warnings


ELASTIC_TIMEOUT_S = 15.0  # how long the driver waits for a silent worker on a live node to rejoin


def test_a_worker_frozen_for_good_on_a_live_node_is_dropped_after_elastic_timeout(cluster, caplog):
    """Rank 1's process is stopped and never continued (a process deadlocked in C code, or cut off from
    its peers while its node answers): its peer's collective fails after timeout_s and rolls back, the
    driver waits for it (slow is not dead) until elastic_timeout, then drops it without blacklisting its
    node, and the job trains on and finishes without it, nothing committed lost."""
    caplog.set_level(logging.WARNING, logger="hvdray.driver")
    use_nodes(cluster, 2)
    recorder = Recorder()
    frozen: dict[str, float] = {}

    def freeze(record):
        os.kill(record["pid"], signal.SIGSTOP)
        frozen.update(pid=record["pid"], at=time.monotonic())

    recorder.on(lambda r: r.get("kind") == "commit" and r["rank"] == 1 and r["epoch"] == 0, freeze)
    try:
        with elastic_executor(min_workers=1, max_workers=2, elastic_timeout=ELASTIC_TIMEOUT_S) as ex:
            results = ex.run(train_job, args=[EPOCHS], callbacks=[recorder])
    finally:
        if "pid" in frozen:  # the driver had it killed; never leave a stopped process behind
            try:
                os.kill(int(frozen["pid"]), signal.SIGCONT)
            except ProcessLookupError:
                pass
    check_invariants(results, recorder, EPOCHS)
    assert 1 in results[0]["sizes"], results[0]["sizes"]  # it trained on alone meanwhile
    states = [t["state"] for t in recorder.transitions()]
    assert "recovering" in states, states
    recovering = next(t for t in recorder.transitions() if t["state"] == "recovering")
    after = next(t for t in recorder.transitions() if t["time"] > recovering["time"] and t["state"] == "running")
    assert after["time"] - recovering["time"] >= ELASTIC_TIMEOUT_S - 1, (recovering, after)  # waited for, not dropped
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert [w for w in warnings if "did not rejoin within elastic_timeout" in w], warnings
    assert not [w for w in warnings if "blacklisted" in w], warnings
