"""Soak: many executor lifecycles and many collectives leak nothing.

* 10 start / run / shutdown cycles in one driver process leave the driver's open file descriptors
  and threads, the cluster's live actors (none: each job keeps its coordinator in its first worker; a
  coordinator host an earlier test's job started is not counted) and placement groups, its free CPUs
  and /dev/shm as they were after the first cycle (which warms up Ray's own connections), and make no
  new Ray actor class
  (each one Ray exports and keeps in the driver: they grew its memory by ~0.5 MB a cycle);
* 10,000 collectives in one worker process leave its file descriptors and threads unchanged.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable

import pytest
import ray.cloudpickle

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

#: enough for a leak of one descriptor, thread, actor or segment per cycle to show past the slack (9 cycles are
#: measured after the warm-up, against a slack of 8 descriptors); the 200-cycle soak with its figures is
#: ``benchmarks/soak.py``
CYCLES = 10
COLLECTIVES = 10_000
#: Slack for descriptors Ray opens lazily (log files, gRPC channels) the first few times.
FD_SLACK = 8
THREAD_SLACK = 2


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _actor_classes() -> int:
    """Classes derived from hvdray's actor classes: ``ray.remote`` derives one each time it is called."""
    import gc

    from hvdray.driver.coordinator_host import CoordinatorHost
    from hvdray.worker.actor import Worker

    return sum(isinstance(o, type) and issubclass(o, (Worker, CoordinatorHost)) for o in gc.get_objects())


def _shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _cluster_usage(actors_left_behind: Callable[[], list[dict]]) -> dict[str, float]:
    from ray.util import placement_group_table

    # not counted: the driver's coordinator host, which an earlier test's job may have started, and Ray Data's
    # statistics actor (detached) once an earlier module has used Ray Data on this Ray: both stay by design
    groups = [g for g in placement_group_table().values() if g["state"] != "REMOVED"]
    return {
        "actors": len(actors_left_behind()),
        "placement_groups": len(groups),
        "free_cpus": ray.available_resources().get("CPU", 0.0),
    }


def _rank_and_sum() -> float:
    import torch

    import hvdray.torch as hvd

    hvd.init()
    return float(hvd.allreduce(torch.ones(4), name="soak", op=hvd.Sum).sum())


def _wait_for(predicate, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return predicate()


@pytest.mark.slow
@pytest.mark.timeout(900)  # ~3 s a cycle on the 2-core CI machine: each cycle starts fresh worker processes
def test_executor_lifecycles_leak_nothing(ray_local, actors_left_behind):
    from hvdray import RayExecutor

    settings = RayExecutor.create_settings(timeout_s=30, placement_group_timeout_s=60)

    def cycle() -> None:
        executor = RayExecutor(settings, num_workers=2)
        executor.start()
        try:
            assert executor.run(_rank_and_sum) == [8.0, 8.0]
        finally:
            executor.shutdown()

    cycle()  # warm-up: Ray opens its channels and starts its worker pool here
    total_cpus = ray.cluster_resources()["CPU"]
    # no actor stays: a job of 2 keeps its coordinator in its first worker
    baseline_usage = {"actors": 0, "placement_groups": 0, "free_cpus": total_cpus}
    # the first cycle's (and earlier tests') placement groups and actors go away asynchronously
    assert _wait_for(lambda: _cluster_usage(actors_left_behind) == baseline_usage), (
        f"not everything was released after one cycle: {_cluster_usage(actors_left_behind)} != {baseline_usage}"
    )
    fds, threads, shm, classes = _open_fds(), threading.active_count(), _shm_entries(), _actor_classes()

    started = time.monotonic()
    for _ in range(CYCLES - 1):
        cycle()
    elapsed = time.monotonic() - started

    assert _wait_for(lambda: _cluster_usage(actors_left_behind) == baseline_usage), (
        f"after {CYCLES} cycles: {_cluster_usage(actors_left_behind)} != {baseline_usage}"
    )
    assert _open_fds() <= fds + FD_SLACK, f"driver file descriptors grew from {fds} to {_open_fds()}"
    assert threading.active_count() <= threads + THREAD_SLACK, (
        f"driver threads grew from {threads} to {threading.active_count()}"
    )
    assert _shm_entries() <= shm, f"new /dev/shm entries: {_shm_entries() - shm}"
    assert _actor_classes() == classes, f"Ray actor classes grew from {classes} to {_actor_classes()}"
    print(f"{CYCLES} executor cycles in {elapsed:.0f} s ({elapsed / (CYCLES - 1):.2f} s each)")


def _many_collectives(count: int) -> dict[str, int]:
    import threading

    import torch

    import hvdray.torch as hvd

    hvd.init()
    t = torch.ones(16)

    def burst(tag: str, n: int) -> None:
        handles = [hvd.allreduce_async(t, name=f"{tag}.{i % 64}", op=hvd.Sum) for i in range(n)]
        for h in handles:
            hvd.synchronize(h)

    for i in range(4):  # warm-up: the engine thread, the response cache, Gloo's pairs
        burst(f"warm{i}", 64)
    fds, threads = _open_fds(), threading.active_count()
    done = 0
    while done < count:
        burst("steady", 64)  # 64 names in flight at once, reused every burst (the cached path)
        hvd.barrier()
        done += 65
    hvd.allgather(torch.tensor([hvd.rank()]), name="soak.gather")
    return {"fds_before": fds, "fds_after": _open_fds(), "threads_before": threads,
            "threads_after": threading.active_count(), "done": done}


@pytest.mark.slow
def test_ten_thousand_collectives_leak_nothing(make_executor):
    executor = make_executor(num_workers=2)
    for stats in executor.run(_many_collectives, args=[COLLECTIVES]):
        assert stats["done"] >= COLLECTIVES
        assert stats["fds_after"] <= stats["fds_before"], stats
        assert stats["threads_after"] <= stats["threads_before"], stats
