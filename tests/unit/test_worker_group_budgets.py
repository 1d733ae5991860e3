"""The worker group's start budgets (no Ray calls): slow is not dead."""

from __future__ import annotations

import time

from hvdray.driver.worker_group import GroupWorker, WorkerGroup
from hvdray.settings import make_settings


def test_an_elastic_workers_set_up_may_take_elastic_timeout_not_timeout_s():
    """Importing torch in a fresh worker on a busy node can take longer than timeout_s: its configure
    call gets elastic_timeout; Ray starting the actor keeps placement_group_timeout_s."""
    settings = make_settings(timeout_s=5, elastic_timeout=300, placement_group_timeout_s=40)
    group = WorkerGroup("x", settings, coordinator=None, runtime_env=None, elastic=True, owns_coordinator=False)
    worker = GroupWorker("w", actor=None, node_id="n")
    configuring = group._awaiting(worker, call=None, configuring=True)
    assert 295 < configuring.deadline - time.monotonic() <= 300
    assert configuring.out_of_time == "it was not configured within elastic_timeout=300.0 s"
    starting = group._awaiting(worker, call=None)
    assert 35 < starting.deadline - time.monotonic() <= 40


def test_a_fixed_groups_started_workers_set_up_within_the_larger_of_timeout_s_and_the_placement_timeout():
    """A fixed group's placement group is granted before its workers start: a short
    placement_group_timeout_s (fail fast on a busy cluster) does not cut their set-up short."""
    for timeout_s, placement_s, budget in ((30, 1, 30), (5, 40, 40)):
        settings = make_settings(timeout_s=timeout_s, placement_group_timeout_s=placement_s)
        group = WorkerGroup("x", settings, coordinator=None, runtime_env=None, elastic=False, owns_coordinator=False)
        starting = group._awaiting(GroupWorker("w", actor=None, node_id="n"), call=None)
        assert budget - 5 < starting.deadline - time.monotonic() <= budget
        assert starting.out_of_time == (
            f"it did not start within {budget} s (the larger of timeout_s={timeout_s} and "
            f"placement_group_timeout_s={placement_s})"
        )
