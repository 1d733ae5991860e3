"""How a job's workers end, on a real local Ray.

A worker whose last call ended exits as the process of a script does at its end (horovodrun's ranks
do): its ``atexit`` handlers run and a file it left open is flushed; a TensorFlow worker's autograph
modules are removed from the temporary directory. Off the happy path: a worker held by an atexit
handler that never returns ends after the patience all the same, and a worker still in a call is killed at once, so that
``shutdown()`` never waits on the user's code.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import ray.cloudpickle

from hvdray import RayExecutor
from hvdray.driver import worker_group

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this module


def _leave_traces(directory: str, hold_exit_on: int = -1) -> int:
    """On each rank: an atexit handler and a file left open (kept, as a script's global would be), and
    on rank ``hold_exit_on`` an atexit handler that never returns (handlers run last first)."""
    import atexit

    import torch

    import hvdray.torch as hvd

    hvd.init()
    hvd.allreduce(torch.ones(4), name="before_exit")
    rank = hvd.rank()
    atexit.register(lambda: Path(directory, f"atexit-{rank}").write_text("ran"))
    left_open = open(Path(directory, f"left-open-{rank}"), "w")  # noqa: SIM115 - the point of the test
    left_open.write("buffered")
    sys._hvdray_test_left_open = left_open  # alive until the interpreter ends
    if rank == hold_exit_on:
        atexit.register(time.sleep, 3600)
    return os.getpid()


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """The pids still alive after ``timeout_s`` (the workers run on this machine)."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def _traces(directory: Path) -> dict[str, str]:
    return {path.name: path.read_text() for path in sorted(directory.iterdir())}


def test_idle_workers_exit_as_a_script_ends(ray_local, tmp_path, coordinator_place):
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=20), num_workers=2)
    executor.start()
    pids = executor.run(_leave_traces, args=(str(tmp_path),))
    started = time.monotonic()
    executor.shutdown()
    assert time.monotonic() - started < 3
    assert _wait_gone(pids, 15) == []
    assert _traces(tmp_path) == {
        "atexit-0": "ran", "atexit-1": "ran", "left-open-0": "buffered", "left-open-1": "buffered",
    }


def test_an_elastic_jobs_workers_exit_as_a_script_ends(ray_local, tmp_path):
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=20), min_workers=2, max_workers=2)
    executor.start()
    try:
        pids = executor.run(_leave_traces, args=(str(tmp_path),))
        assert _wait_gone(pids, 15) == []  # the run's workers end with the run
    finally:
        executor.shutdown()
    assert _traces(tmp_path) == {
        "atexit-0": "ran", "atexit-1": "ran", "left-open-0": "buffered", "left-open-1": "buffered",
    }


def test_a_worker_held_at_exit_ends_after_the_patience(ray_local, tmp_path, monkeypatch):
    monkeypatch.setattr(worker_group, "WORKER_EXIT_PATIENCE_S", 2.0)
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=20), num_workers=2)
    executor.start()
    pids = executor.run(_leave_traces, args=(str(tmp_path), 1))
    started = time.monotonic()
    executor.shutdown()
    assert time.monotonic() - started < 2  # the driver does not wait for the handler
    assert _wait_gone(pids[:1], 15) == []
    assert _wait_gone(pids[1:], 1.0) == pids[1:], "rank 1 should be held by its handler until the patience"
    assert _wait_gone(pids[1:], 15) == []
    # rank 1 ended in its blocking handler: its other handler never ran, nor was its file flushed
    assert _traces(tmp_path) == {"atexit-0": "ran", "left-open-0": "buffered", "left-open-1": ""}


def test_a_worker_still_in_a_call_is_killed_at_once(ray_local, tmp_path):
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=20), num_workers=2)
    executor.start()
    pids = executor.run(_leave_traces, args=(str(tmp_path),))
    executor.run_remote(time.sleep, args=(60,))
    time.sleep(0.5)
    started = time.monotonic()
    executor.shutdown()
    assert time.monotonic() - started < 2
    assert _wait_gone(pids, 5) == []
    assert _traces(tmp_path) == {"left-open-0": "", "left-open-1": ""}


def _trace_a_tf_function() -> dict[str, object]:
    """Trace a tf.function that calls hvdray's ops; which functions autograph converted, and the
    temporary file of the user's own function (TensorFlow removes such files at exit)."""
    import tensorflow as tf
    from tensorflow.python.autograph.pyct import loader

    import hvdray.tensorflow as hvd

    converted: list[tuple[str, str]] = []
    load_source = loader.load_source

    def recording(source, delete_on_exit):
        module, file_name = load_source(source, delete_on_exit)
        converted.append((source.split("def tf__", 1)[1].split("(", 1)[0], file_name))
        return module, file_name

    loader.load_source = recording
    hvd.init()

    @tf.function
    def users_step(x):
        total = hvd.allreduce(x, name="exit.sum") + tf.reduce_sum(hvd.allgather(x)) + hvd.broadcast(x, 0)
        return total * tf.cast(hvd.size(), x.dtype) + tf.cast(hvd.rank_op(), x.dtype)

    try:
        value = users_step(tf.ones(3)).numpy().tolist()
    finally:
        loader.load_source = load_source
    return {"value": value, "converted": [name for name, _ in converted], "files": [path for _, path in converted],
            "pid": os.getpid()}


def test_tensorflow_converts_only_the_users_function_and_removes_its_file_at_exit(ray_local):
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60, placement_group_timeout_s=60), num_workers=2)
    executor.start(extra_env_vars={"TF_CPP_MIN_LOG_LEVEL": "2"})
    try:
        answers = executor.run(_trace_a_tf_function)
    finally:
        executor.shutdown()
    for rank, answer in enumerate(answers):
        # (1 + 6 + 1) * 2 + rank; hvdray's ops run as Python: autograph converted the user's step alone
        assert answer["value"] == [16.0 + rank] * 3
        assert answer["converted"] == ["users_step"], answer["converted"]
    assert _wait_gone([answer["pid"] for answer in answers], 15) == []
    left = [path for answer in answers for path in answer["files"] if Path(path).exists()]
    assert left == []
