"""Elastic training on a real multi-node Ray cluster (several raylets on this machine, 1 CPU each).

A worker process dies by ``os._exit``; nodes removed and joining at every moment of an elastic job are
the fault-injection matrix's (test_elastic_faults.py).
Every test checks the same invariants: rank 0's committed epochs are exactly the planned range, no
process ever resumes before an epoch it had itself committed (no committed epoch lost), every rank
ends with the same parameters, and the test ends within a stated bound.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import ray.cloudpickle

from hvdray import ElasticJobError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import elastic_checks as checks  # noqa: E402 - shared with the fault-injection matrix
from elastic_checks import (  # noqa: E402
    EPOCHS, Recorder, check_invariants, elastic_executor, remove_node_of, train_job, use_nodes,
)
from elastic_checks import cluster  # noqa: E402,F401 - the fixture

ray.cloudpickle.register_pickle_by_value(checks)
pytestmark = pytest.mark.slow


def test_worker_process_dies_job_recovers_and_regrows_after_cooldown(cluster, tmp_path):
    use_nodes(cluster, 3)
    started = time.monotonic()
    recorder = Recorder()
    marker = str(tmp_path / "died")
    with elastic_executor(min_workers=2, max_workers=3, cooldown_range=(1, 2)) as ex:
        results = ex.run(train_job, args=[EPOCHS], kwargs={"die": (1, 1, marker), "hold": (3, 3, 60.0)},
                         callbacks=[recorder])
    assert os.path.exists(marker)
    check_invariants(results, recorder)
    sizes = results[0]["sizes"]
    assert sizes[0] == 3 and 2 in sizes and sizes[-1] == 3, sizes  # shrank, then the node came back
    assert time.monotonic() - started < 150


def test_reset_limit_exceeded_ends_with_clear_error(cluster, tmp_path):
    use_nodes(cluster, 3)
    started = time.monotonic()
    with elastic_executor(min_workers=2, max_workers=3, reset_limit=0) as ex:
        with pytest.raises(ElasticJobError, match="reset_limit=0"):
            ex.run(train_job, args=[EPOCHS], kwargs={"die": (1, 1, str(tmp_path / "died"))})
    assert time.monotonic() - started < 90


def test_below_min_workers_longer_than_elastic_timeout_ends_with_clear_error(cluster):
    use_nodes(cluster, 2)
    started = time.monotonic()
    recorder = Recorder()
    recorder.at_commit(0, lambda: remove_node_of(cluster, recorder.node_of_rank(1)))
    with elastic_executor(min_workers=2, max_workers=2, elastic_timeout=3) as ex:
        with pytest.raises(ElasticJobError, match=r"fewer than min_workers=2.*elastic_timeout=3"):
            ex.run(train_job, args=[EPOCHS], callbacks=[recorder])
    assert recorder.transitions()[-1]["state"] == "errored"
    assert time.monotonic() - started < 90
