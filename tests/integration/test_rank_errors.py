"""What a rank's error in its function does to the run and to the workers: the run raises at once
naming the rank (its exception's own type, the worker's traceback along), ``sys.exit`` in a rank is that
rank's result, and the next call gets the same workers unless one is busy or broken.

The checks share one pair of workers (tests/conftest.py's ``shared_executor``): what one leaves behind is what
the next call of any executor meets."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import ray.cloudpickle

from hvdray import WorkerLostError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import collective_checks as checks  # noqa: E402 - shared with the other executor and collective tests

ray.cloudpickle.register_pickle_by_value(checks)


def test_worker_exception_raises_promptly_with_rank_and_executor_recovers(shared_executor):
    def fail_on_rank_one():
        import torch

        import hvdray.torch as hvd

        hvd.init()
        if hvd.rank() == 1:
            raise KeyError("bad batch 17")
        # rank 0 waits on a collective rank 1 never joins: it must be stopped, not left hanging
        hvd.allreduce(torch.ones(1), name="never-completed")
        time.sleep(60)

    started = time.monotonic()
    with pytest.raises(KeyError, match="bad batch 17") as info:
        shared_executor.run(fail_on_rank_one)
    assert time.monotonic() - started < 10
    assert any("rank 1 of 2" in note for note in getattr(info.value, "__notes__", []))
    assert str(info.value).startswith("rank 1 of 2: 'bad batch 17'\n"), str(info.value)
    assert "fail_on_rank_one" in str(info.value)  # the worker's traceback comes along
    assert shared_executor.run(checks.rank_and_size) == [(r, 2, r, 2, 0, 1) for r in range(2)]


def test_str_of_a_workers_error_names_its_rank_for_builtin_and_custom_exceptions(shared_executor):
    class QuotaError(Exception):  # a user's exception whose __init__ is not (message)
        def __init__(self, user, limit):
            super().__init__(user, limit)
            self.user, self.limit = user, limit

        def __str__(self):
            return f"{self.user} is over the quota of {self.limit}"

    def fail_on(rank, error):
        import hvdray.torch as hvd

        hvd.init()
        if hvd.rank() == rank:
            raise error

    for rank, error in [(1, ValueError("bad value")), (0, ZeroDivisionError("division by zero")),
                        (1, QuotaError("ana", 3))]:
        with pytest.raises(type(error)) as info:
            shared_executor.run(fail_on, args=[rank, error])
        assert str(info.value).startswith(f"rank {rank} of 2: {error}\n"), str(info.value)
        assert "fail_on" in str(info.value)  # the worker's traceback
    assert (info.value.user, info.value.limit) == ("ana", 3)
    try:
        shared_executor.run(fail_on, args=[0, ValueError("caught as itself")])
    except ValueError as caught:  # what a user writes
        assert "rank 0 of 2: caught as itself" in str(caught)


def _pid_after(rank_raises: int, then: str):
    """Rank ``rank_raises`` raises; the other rank then waits for it in an allreduce (``"allreduce"``),
    goes on computing for 10 s (``"busy"``), or finds its engine stopped by the raising rank's
    ``hvd.shutdown()`` (``"shutdown"``). Returns the worker's pid (from the ranks that do not raise)."""
    import os
    import time

    import torch

    import hvdray.torch as hvd

    hvd.init()
    if hvd.rank() == rank_raises:
        if then == "shutdown":
            hvd.shutdown()
        raise ValueError(f"rank {rank_raises} gives up")
    if then == "busy":
        time.sleep(10)
    hvd.allreduce(torch.ones(2))  # unnamed: the ranks' counts of generated names now differ
    return os.getpid()


def _pid_and_sum():
    import os

    import torch

    import hvdray.torch as hvd

    hvd.init()
    return os.getpid(), hvd.allreduce(torch.ones(1), op=hvd.Sum).item()  # the same generated name on every rank


def test_a_rank_that_raises_leaves_the_workers_to_the_next_call_unless_one_is_busy_or_broken(shared_executor):
    """A rank's function raises: ``run`` raises at once, and the next call takes the same worker
    processes (their state, such as a stateful executable, with them) once every other worker's call
    has ended, as its ops the raising rank never submitted fail naming it; their unnamed ops get the
    same generated names again, though the ranks submitted different ops before. A worker still busy in the
    failed call after a few seconds, or one whose engine stopped (the raising rank shut hvdray down
    under it), gives the next call new workers instead."""
    pids = [pid for pid, total in shared_executor.run(_pid_and_sum)]
    assert shared_executor.run(_pid_and_sum) == [(pid, 2.0) for pid in pids]

    for rank in (1, 0):  # the peer waits in an allreduce: its op fails at once and its call ends
        started = time.monotonic()
        with pytest.raises(ValueError, match=f"rank {rank} gives up"):
            shared_executor.run(_pid_after, args=[rank, "allreduce"])
        assert shared_executor.run(_pid_and_sum) == [(pid, 2.0) for pid in pids], "the workers were replaced"
        assert time.monotonic() - started < 10

    with pytest.raises(ValueError, match="rank 1 gives up"):
        shared_executor.run(_pid_after, args=[1, "busy"])  # raises at once, while rank 0 computes on
    fresh = [pid for pid, total in shared_executor.run(_pid_and_sum)]
    assert not set(fresh) & set(pids), (fresh, pids)
    assert [total for _, total in shared_executor.run(_pid_and_sum)] == [2.0, 2.0]

    with pytest.raises(ValueError, match="rank 1 gives up"):
        shared_executor.run(_pid_after, args=[1, "shutdown"])
    again = [pid for pid, total in shared_executor.run(_pid_and_sum)]
    assert not set(again) & set(fresh), (again, fresh)


def _exits_on_rank_1(code):
    import os
    import sys

    import torch

    import hvdray.torch as hvd

    hvd.init()
    if hvd.rank() == 1:
        if code == "exit_actor":
            import ray

            ray.actor.exit_actor()  # Ray's own intentional exit (a SystemExit that Ray marks)
        sys.exit(code)
    hvd.allreduce(torch.ones(2), name="after_the_exit")  # rank 1 never submits it
    return os.getpid()


def test_sys_exit_in_a_ranks_function_is_that_ranks_result_not_a_dead_worker(shared_executor):
    """``sys.exit(n)`` in the function, as in a script: 0 or None ends the rank's call (its result
    None), any other code fails the run naming the rank and the code. The worker process lives on (in a
    Ray actor SystemExit would end it, and run() reported a worker that died unexpectedly); the peer
    waiting for the rank in an allreduce is told the rank left its function."""
    pids = [pid for pid, _ in shared_executor.run(_pid_and_sum)]
    with pytest.raises(RuntimeError, match=r"called sys\.exit\(3\) on rank 1"):
        shared_executor.run(_exits_on_rank_1, args=[3])
    assert [pid for pid, _ in shared_executor.run(_pid_and_sum)] == pids, "the workers were replaced"
    for code in (0, None):
        with pytest.raises(Exception, match="rank 1 returned from its function") as info:
            shared_executor.run(_exits_on_rank_1, args=[code])
        assert "rank 0 of 2" in str(info.value)
        assert [pid for pid, _ in shared_executor.run(_pid_and_sum)] == pids
    with pytest.raises(WorkerLostError, match="rank 1"):  # ray.actor.exit_actor() still ends the worker
        shared_executor.run(_exits_on_rank_1, args=["exit_actor"])
    assert not set(pid for pid, _ in shared_executor.run(_pid_and_sum)) & set(pids)
