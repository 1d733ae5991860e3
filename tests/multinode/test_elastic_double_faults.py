"""Two faults at once: an elastic job on three nodes survives two of its workers lost together, and a
second fault in the middle of the recovery from the first (:func:`hvdray.testing.faults.combine`).

- ``two-exits-at-step``: ranks 1 and 2 exit in the same training step;
- ``node-removed-and-exit-at-step``: rank 1's node is removed while rank 2 exits, in the same step;
- ``exit-at-step-then-exit-in-rendezvous``: rank 1 exits in a step, and rank 1 of the epoch formed
  without it exits in that epoch's rendezvous, before the recovery is complete;
- ``node-joins-while-exit-at-step``: a fourth node joins while rank 1 stands in a step in which rank 2
  exits: the job recovers and grows back to three workers (the last epoch waits for the third).

Each case checks the same invariants as the single-fault matrix (``tests/multinode/test_elastic_faults.py``):
both faults happened where they were planned, every epoch committed exactly once in the result, identical
parameters on every rank, no commit lost, and the job finished within a bound (quiet machine only)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import ray.cloudpickle

from hvdray.testing import faults

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import elastic_checks  # noqa: E402 - shared with test_elastic_faults.py
from elastic_checks import Recorder, check_invariants, cluster_responder, elastic_executor, train_job, use_nodes  # noqa: E402
from elastic_checks import cluster  # noqa: E402,F401 - the fixture

ray.cloudpickle.register_pickle_by_value(elastic_checks)
pytestmark = pytest.mark.slow

EPOCHS = 4
#: (point, action, rank, min_epoch) of each fault
CASES = {
    "two-exits-at-step": [("step", "exit", 1, 1), ("step", "exit", 2, 1)],
    "node-removed-and-exit-at-step": [("step", "remove_node", 1, 1), ("step", "exit", 2, 1)],
    "exit-at-step-then-exit-in-rendezvous": [("step", "exit", 1, 1), ("rendezvous", "exit", 1, 2)],
    "node-joins-while-exit-at-step": [("step", "join", 1, 1), ("step", "exit", 2, 1)],
}
#: train_job's ``hold`` per case: the last epoch waits until the job has its workers again
HOLD = {"node-joins-while-exit-at-step": (EPOCHS - 1, 3, 120.0)}


@pytest.mark.parametrize("case", list(CASES))
def test_elastic_job_survives_two_faults(cluster, tmp_path, case):
    use_nodes(cluster, 3)
    started = time.monotonic()
    recorder = Recorder()
    responders, plans = [], []
    for index, (point, action, rank, min_epoch) in enumerate(CASES[case]):
        directory = tmp_path / f"fault{index}"
        directory.mkdir()
        plans.append(faults.plan(point, action, str(directory), rank=rank, min_epoch=min_epoch))
        responders.append(cluster_responder(cluster, str(directory)))
    with elastic_executor(min_workers=1, max_workers=3, cooldown_range=(1, 2)) as ex:
        ex.start(extra_env_vars=faults.combine(*plans))
        results = ex.run(train_job, args=[EPOCHS], kwargs={"hold": HOLD.get(case)}, callbacks=[recorder, *responders])
    elapsed = time.monotonic() - started
    fired = [responder.fired() for responder in responders]
    for planned, what in zip(CASES[case], fired):
        point, action, rank, min_epoch = planned
        assert what is not None and (what["point"], what["action"], what["rank"]) == (point, action, rank), (planned, what)
        assert what["epoch"] >= min_epoch, (planned, what)
    assert fired[0]["pid"] != fired[1]["pid"], "one process took both faults"
    if case == "exit-at-step-then-exit-in-rendezvous":  # the second hit the epoch re-formed after the first
        assert fired[1]["epoch"] > fired[0]["epoch"], fired
    else:  # both in the same epoch's step
        assert fired[0]["epoch"] == fired[1]["epoch"], fired
    check_invariants(results, recorder, EPOCHS)
    if case in HOLD:
        assert len(results) == 3 and results[0]["sizes"][-1] == 3, results[0]["sizes"]
    assert any(t["state"] == "recovering" for t in recorder.transitions())
    assert elapsed < 150, f"took {elapsed:.0f} s"
