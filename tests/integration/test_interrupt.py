"""Ctrl-C in the driver while ``run`` waits: the workers stop, the executor stays usable, nothing leaks.

A real SIGINT is sent to this process (as a terminal's Ctrl-C would) while the workers are busy in a
loop of collectives. ``run`` must raise ``KeyboardInterrupt`` promptly, the busy workers must be
gone, and the next ``run`` on the same executor must work on fresh workers. The same holds for an
elastic executor, and for a Jupyter kernel interrupted in the middle of a cell (the kernel stays
usable: the next cell trains again on the same executor). Ctrl-C while ``start`` waits for its placement
group leaves nothing reserved, and ``start`` works on the same executor afterwards.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest
import ray
import ray.cloudpickle

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

#: From SIGINT to ``run`` raising, on a loaded 2-core machine.
INTERRUPT_BOUND_S = 10.0


#: the tests here send SIGINT to this process (the notebook test to its kernel): tests/conftest.py
pytestmark = pytest.mark.usefixtures("python_sigint_handler")


def _busy(seconds: float) -> int:
    import torch

    import hvdray.torch as hvd

    hvd.init()
    deadline = time.monotonic() + seconds
    steps = 0
    while time.monotonic() < deadline:
        hvd.allreduce(torch.ones(8), name="busy", op=hvd.Sum)
        steps += 1
    return steps


def _rank() -> int:
    import hvdray.torch as hvd

    hvd.init()
    return hvd.rank()


def _interrupt_after(seconds: float) -> threading.Timer:
    timer = threading.Timer(seconds, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    return timer


def _alive(actor) -> bool:
    try:
        ray.get(actor.slot.remote(), timeout=10)
        return True
    except ray.exceptions.RayActorError:
        return False


def _worker_actors(executor) -> list:
    return [worker.actor for worker in executor._group.ranked()]


def test_ctrl_c_during_run_stops_the_workers_and_keeps_the_executor_usable(make_executor):
    executor = make_executor(num_workers=2)
    busy_workers = _worker_actors(executor)
    _interrupt_after(3.0)
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        executor.run(_busy, args=[120.0])
    assert time.monotonic() - started < 3.0 + INTERRUPT_BOUND_S
    assert not any(_alive(w) for w in busy_workers), "the interrupted workers are still running"

    assert executor.run(_rank) == [0, 1]  # fresh workers, same executor
    assert not set(_worker_actors(executor)) & set(busy_workers)


def test_ctrl_c_during_an_elastic_run(ray_local):
    from hvdray import RayExecutor

    settings = RayExecutor.create_settings(timeout_s=20, placement_group_timeout_s=30)
    executor = RayExecutor(settings, min_workers=2, max_workers=2)
    executor.start()
    try:
        _interrupt_after(6.0)
        with pytest.raises(KeyboardInterrupt):
            executor.run(_busy, args=[120.0])
        assert sorted(executor.run(_rank)) == [0, 1]
    finally:
        executor.shutdown()


def test_ctrl_c_during_start_releases_what_it_reserved_and_start_can_be_called_again(
    make_executor, actors_left_behind
):
    """start() waits for its placement group (three of the four CPUs are held by another one): Ctrl-C
    there leaves no placement group or actor of the executor behind, and once the CPUs are free the same
    executor starts and runs (before, an interrupted or failed start shut the executor down for good)."""
    from ray.util import placement_group_table
    from ray.util.placement_group import placement_group, remove_placement_group

    blocker = placement_group([{"CPU": 3}])
    ray.get(blocker.ready(), timeout=30)
    executor = make_executor(num_workers=2, start=False)
    try:
        _interrupt_after(1.5)
        started = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            executor.start()
        assert time.monotonic() - started < 1.5 + INTERRUPT_BOUND_S
        deadline = time.monotonic() + 10
        while True:
            groups = [pg for pg, row in placement_group_table().items() if row["state"] != "REMOVED"]
            actors = actors_left_behind()
            if (groups == [blocker.id.hex()] and not actors) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert groups == [blocker.id.hex()] and not actors, (groups, actors)
    finally:
        remove_placement_group(blocker)
    executor.start()
    assert executor.run(_rank) == [0, 1]


NOTEBOOK_CELLS = {
    "setup": """
import sys, time
sys.path.insert(0, {root!r})
import ray, torch
from hvdray import RayExecutor
ray.init(address={address!r}, log_to_driver=False)  # the test's Ray: a notebook that joins a running one
executor = RayExecutor(RayExecutor.create_settings(timeout_s=20), num_workers=2)
executor.start()

def busy(seconds):
    import hvdray.torch as hvd
    hvd.init()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        hvd.allreduce(torch.ones(8), name="busy")
    return "finished"

def rank():
    import hvdray.torch as hvd
    hvd.init()
    return hvd.rank()
print("ready")
""",
    "long": "executor.run(busy, args=[120.0])",
    "again": "print('ranks', executor.run(rank)); executor.shutdown(); ray.shutdown()",
}


def _execute(client, code: str, timeout: float):
    """Run ``code`` in the kernel; returns (status, stdout text, error name)."""
    msg_id = client.execute(code)
    stdout, error = [], None
    deadline = time.monotonic() + timeout
    while True:
        msg = client.get_iopub_msg(timeout=max(1.0, deadline - time.monotonic()))
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream" and content.get("name") == "stdout":
            stdout.append(content["text"])
        elif kind == "error":
            error = content["ename"]
        elif kind == "status" and content["execution_state"] == "idle":
            break
    while True:  # skip stale replies (wait_for_ready may have sent kernel_info more than once)
        reply = client.get_shell_msg(timeout=30)
        if reply["parent_header"].get("msg_id") == msg_id:
            break
    return reply["content"]["status"], "".join(stdout), error


@pytest.mark.slow
def test_interrupting_a_notebook_cell_keeps_the_kernel_usable(ray_local, tmp_path, monkeypatch):
    jupyter_client = pytest.importorskip("jupyter_client")
    kernelspec = pytest.importorskip("ipykernel.kernelspec")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    prefix = tmp_path / "jupyter"
    kernelspec.install(kernel_name="hvdray-interrupt", prefix=str(prefix))
    monkeypatch.setenv("JUPYTER_PATH", str(prefix / "share" / "jupyter"))

    manager = jupyter_client.KernelManager(kernel_name="hvdray-interrupt")
    manager.start_kernel(cwd=str(tmp_path))
    client = manager.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=120)
        address = ray_local.get_runtime_context().gcs_address
        status, out, _ = _execute(client, NOTEBOOK_CELLS["setup"].format(root=root, address=address), timeout=180)
        assert status == "ok" and "ready" in out, out

        timer = threading.Timer(4.0, manager.interrupt_kernel)  # the workers have started: they are busy by then
        timer.start()
        started = time.monotonic()
        status, _, error = _execute(client, NOTEBOOK_CELLS["long"], timeout=120)
        assert (status, error) == ("error", "KeyboardInterrupt")
        assert time.monotonic() - started < 4.0 + INTERRUPT_BOUND_S

        status, out, error = _execute(client, NOTEBOOK_CELLS["again"], timeout=180)
        assert status == "ok", error
        assert "ranks [0, 1]" in out
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
