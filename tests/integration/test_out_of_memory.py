"""A worker killed for using too much memory becomes an error that says so.

Ray's memory monitor (the mechanism that kills workers before the kernel's OOM killer does) runs here
for real, with its threshold set a little above the memory this machine uses right now, so that one
worker allocating a few hundred MiB at a time crosses it within seconds. ``run`` must raise
``WorkerLostError`` that says the node ran out of memory and names the rank; the executor then works
again on fresh workers.
"""

from __future__ import annotations

import sys
import time

import pytest
import ray
import ray.cloudpickle

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

HEADROOM = 0.12  # fraction of the machine's memory above today's use at which the monitor kills (Ray and its workers need ~4 %)


@pytest.fixture(scope="module")
def ray_with_memory_monitor():
    psutil = pytest.importorskip("psutil")
    if ray.is_initialized():
        ray.shutdown()
    memory = psutil.virtual_memory()
    used = 1 - memory.available / memory.total
    ray.init(
        address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
        _system_config={"memory_usage_threshold": min(0.95, used + HEADROOM), "memory_monitor_refresh_ms": 50},
    )
    yield
    ray.shutdown()


def _hog_memory_on_rank_1() -> str:
    import hvdray.torch as hvd

    hvd.init()
    if hvd.rank() == 1:
        blocks = []
        while True:
            blocks.append(bytearray(256 << 20))  # touched pages: really resident
            time.sleep(0.05)
    time.sleep(120)
    return "not killed"


def _rank() -> int:
    import hvdray.torch as hvd

    hvd.init()
    return hvd.rank()


def test_worker_killed_for_memory_is_reported_as_out_of_memory(ray_with_memory_monitor):
    from hvdray import RayExecutor, WorkerLostError

    executor = RayExecutor(RayExecutor.create_settings(timeout_s=20, placement_group_timeout_s=60), num_workers=2)
    executor.start()
    try:
        started = time.monotonic()
        with pytest.raises(WorkerLostError, match="ran out of memory") as caught:
            executor.run(_hog_memory_on_rank_1)
        assert time.monotonic() - started < 60
        assert "rank" in str(caught.value)
        assert executor.run(_rank) == [0, 1]
    finally:
        executor.shutdown()
