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
