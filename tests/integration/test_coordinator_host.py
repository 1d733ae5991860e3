"""Where a job's coordinator lives: in a small fixed job's first worker, or in the driver's one host.

A fixed job of at most ``HOSTED_BY_WORKER_UP_TO`` workers keeps its coordinator in its first worker
(its start creates no process beyond its workers): these tests check that it does, that the worker
answers every rank's waiting call at once while it runs, and that losing that worker fails the run
naming it. Other jobs share one host per driver, started by the first and kept for the next: these
tests check that two jobs at once in one host do not see each other, that a job's token is refused once
its executor shut down, that later executors reuse the host, and that a killed or frozen host is
replaced instead of failing or hanging the next start.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest
import ray
import ray.cloudpickle

from hvdray import RayExecutor
from hvdray.collective.topology import WorkerSlot
from hvdray.driver.coordinator import token_digest
from hvdray.driver.coordinator_host import (
    COORDINATION_THREADS,
    CoordinatorClient,
    fixed_worker_class,
    start_job_coordinator,
)
from hvdray.driver.failures import WorkerLostError

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

SLOTS = [WorkerSlot(node_id="n", hostname="h", ip="127.0.0.1", gpu_ids=())]


def _host_id(job) -> str:
    return job.client.handle._actor_id.hex()


def _host_pid(job) -> int:
    from ray._private.state import actors as gcs_actors

    return next(a["Pid"] for a in gcs_actors().values() if a["ActorID"] == _host_id(job) and a["State"] == "ALIVE")


def _sum_of_ranks() -> float:
    import torch

    import hvdray.torch as hvd

    hvd.init()
    return float(hvd.allreduce(torch.tensor([float(hvd.rank())]), name="ranks", op=hvd.Sum)[0])


def test_jobs_in_one_host_keep_their_own_tables(ray_local):
    first, second = start_job_coordinator(), start_job_coordinator()
    try:
        assert _host_id(first) == _host_id(second)  # one process for both
        ray.get(first.client.kv_set.remote("e0/k", b"first"))
        # membership and keys are per job: the second job has no epoch and no key yet
        assert ray.get(second.client.epoch.remote()) == 0
        assert ray.get(second.client.kv_check.remote(["e0/k"])) is False
        epoch, _, _ = ray.get(second.client.assign.remote(SLOTS, ["w"]))
        assert epoch == 1 and ray.get(first.client.epoch.remote()) == 0
        ray.get(second.close())  # close() does not wait: a call sent after it could run first
        with pytest.raises(ray.exceptions.RayTaskError, match="PermissionError"):
            ray.get(second.client.epoch.remote())
        assert ray.get(first.client.epoch.remote()) == 0  # closing one job leaves the other alone
        assert ray.get(first.client.handle.jobs.remote()) == 1
    finally:
        first.close()
        second.close()


def test_a_closed_jobs_waits_end_at_once(ray_local):
    job = start_job_coordinator()
    epoch, _, _ = ray.get(job.client.assign.remote(SLOTS, ["w"]))
    waiting = job.client.kv_wait.remote([f"e{epoch}/never"], 60.0)
    time.sleep(0.5)
    asked = time.monotonic()
    job.close()
    assert ray.get(waiting, timeout=30) == "superseded"
    assert time.monotonic() - asked < 10


def _alive_actors() -> set[str]:
    from ray._private.state import actors as gcs_actors

    return {a["ActorID"] for a in gcs_actors().values() if a["State"] == "ALIVE"}


def test_a_small_fixed_jobs_coordinator_lives_in_its_first_worker_and_starts_no_process(ray_local):
    settings = RayExecutor.create_settings(timeout_s=30, placement_group_timeout_s=60)
    before = _alive_actors()
    with RayExecutor(settings, num_workers=2) as first, RayExecutor(settings, num_workers=2) as beside:
        assert first.run(_sum_of_ranks) == [1.0, 1.0] and beside.run(_sum_of_ranks) == [1.0, 1.0]
        workers = {w.actor._actor_id.hex() for ex in (first, beside) for w in ex._group.workers.values()}
        assert _alive_actors() - before == workers  # the two jobs' workers, and no other actor
        for executor in (first, beside):
            assert executor._group.coordinator.handle._actor_id.hex() == executor._group.workers["0"].actor._actor_id.hex()
        # each job's table refuses the other's token
        with pytest.raises(ray.exceptions.RayTaskError, match="PermissionError"):
            ray.get(CoordinatorClient(first._group.coordinator.handle, beside._group.coordinator._token).epoch.remote())


def test_the_coordinating_worker_answers_every_waiting_call_at_once(ray_local):
    """Each of a job's ranks may wait in the coordinator at once (its rendezvous read, its dataset
    shard), besides the driver: the first worker's coordination group answers the call that ends the
    waits even with all of them waiting, and a worker holding no table refuses coordinator calls."""
    token = b"t" * 32
    holder = fixed_worker_class(hosts_coordinator=True).remote(token_digest(token))
    client = CoordinatorClient(holder, token)
    epoch, _, _ = ray.get(client.assign.remote(SLOTS, ["w"]))
    waits = [client.kv_wait.remote([f"e{epoch}/k"], 60.0) for _ in range(COORDINATION_THREADS - 1)]
    time.sleep(1.0)
    asked = time.monotonic()
    ray.get(client.kv_set.remote(f"e{epoch}/k", b"v"), timeout=30)
    assert ray.get(waits, timeout=30) == ["ok"] * len(waits)
    assert time.monotonic() - asked < 10
    other = fixed_worker_class(hosts_coordinator=False).remote(None)
    with pytest.raises(ray.exceptions.RayTaskError, match="holds no job's coordinator"):
        ray.get(CoordinatorClient(other, token).epoch.remote(), timeout=30)
    for actor in (holder, other):
        ray.kill(actor, no_restart=True)


def test_executors_one_after_another_and_at_once_share_the_host(ray_local, coordinator_in_host):
    settings = RayExecutor.create_settings(timeout_s=30, placement_group_timeout_s=60)
    with RayExecutor(settings, num_workers=2) as first:
        assert first.run(_sum_of_ranks) == [1.0, 1.0]
        host = first._group.coordinator.handle._actor_id.hex()
        with RayExecutor(settings, num_workers=2) as beside:  # at the same time, in the same host
            assert beside.run(_sum_of_ranks) == [1.0, 1.0]
            assert beside._group.coordinator.handle._actor_id.hex() == host
            assert first.run(_sum_of_ranks) == [1.0, 1.0]
    with RayExecutor(settings, num_workers=2) as later:
        assert later.run(_sum_of_ranks) == [1.0, 1.0]
        assert later._group.coordinator.handle._actor_id.hex() == host


def test_a_killed_host_is_replaced(ray_local, coordinator_in_host):
    job = start_job_coordinator()
    ray.kill(job.client.handle, no_restart=True)
    settings = RayExecutor.create_settings(timeout_s=30, placement_group_timeout_s=60)
    with RayExecutor(settings, num_workers=2) as executor:
        assert executor.run(_sum_of_ranks) == [1.0, 1.0]
        assert executor._group.coordinator.handle._actor_id.hex() != _host_id(job)


def test_a_frozen_host_is_replaced_after_its_answer_bound(ray_local):
    """SIGSTOP: the host is alive to Ray but answers nothing; the next start gives up on it after
    ``answer_s`` and starts a new one (killing the frozen one), instead of hanging."""
    job = start_job_coordinator()
    ray.get(job.client.epoch.remote())  # the host is up
    pid = _host_pid(job)
    os.kill(pid, signal.SIGSTOP)
    try:
        asked = time.monotonic()
        fresh = start_job_coordinator(answer_s=2.0)
        assert time.monotonic() - asked < 2.0 + 10
        assert _host_id(fresh) != _host_id(job)
        assert ray.get(fresh.client.epoch.remote(), timeout=60) == 0
        fresh.close()
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:  # killed as it should be
            pass


def _logs_until(seconds: float) -> int:
    import torch

    import hvdray.torch as hvd
    from hvdray import ray_logger

    hvd.init()
    deadline, step = time.monotonic() + seconds, 0
    while time.monotonic() < deadline:
        hvd.allreduce(torch.ones(2), name="step")
        ray_logger.log({"step": step})
        step += 1
        time.sleep(0.05)
    return step


def test_a_coordinator_lost_during_a_run_fails_the_run_and_the_next_run_gets_a_new_one(ray_local, coordinator_place):
    """The process holding the job's coordinator dies while the ranks run and report. Its first worker:
    the run fails naming that worker's rank (not a peer whose coordinator call failed with it). The
    driver's host: the run fails naming the coordinator. Either within ``timeout_s``, never a hang; the
    executor's next run starts new workers with a new coordinator."""
    settings = RayExecutor.create_settings(timeout_s=10, placement_group_timeout_s=60)
    killed: list[float] = []

    def kill_holder(record):
        if not killed:
            killed.append(time.monotonic())
            ray.kill(executor._group.coordinator.handle, no_restart=True)

    with RayExecutor(settings, num_workers=3) as executor:
        holder_rank = executor._ready_group().workers["0"].rank
        expected = (WorkerLostError, f"the worker of rank {holder_rank} \\(of 3\\) died") \
            if coordinator_place == "first worker" else (Exception, "coordinator")
        with pytest.raises(expected[0], match=expected[1]) as failed:
            executor.run(_logs_until, args=[120.0], callbacks=[kill_holder])
        assert killed and time.monotonic() - killed[0] < 10 + 20, str(failed.value)
        assert executor.run(_sum_of_ranks) == [3.0] * 3
