"""A tensor submitted on some ranks only, negotiated by name or already cached: a warning naming it
and the missing ranks, then an error on the waiting rank; the ring still works afterwards."""

from __future__ import annotations

import time

import pytest

from hvdray import RayExecutor


def _only_rank_zero_submits(name: str, cached_steps: int):
    """Rank 0 submits ``name`` after ``cached_steps`` steps on every rank (so it is cached); rank 1 not."""
    import logging

    import torch

    import hvdray.torch as hvd

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.getLogger("hvdray.collective.engine").addHandler(Keep())
    hvd.init()
    for _ in range(cached_steps):
        hvd.allreduce(torch.ones(2), name=name)
    started = time.monotonic()
    error = None
    if hvd.rank() == 0:
        try:
            hvd.allreduce(torch.ones(2), name=name)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            error = f"{type(exc).__name__}: {exc}"
    else:
        time.sleep(3.5)
    hvd.barrier()  # the ring still works after the stalled tensor was dropped
    return error, records, time.monotonic() - started


@pytest.mark.parametrize("cached_steps", [0, 3], ids=["negotiated-by-name", "cached"])
def test_stalled_tensor_warns_then_fails_on_the_waiting_rank(make_executor, cached_steps):
    settings = RayExecutor.create_settings(timeout_s=20, stall_warning_s=1, stall_shutdown_s=2)
    ex = make_executor(settings=settings, num_workers=2)
    (error0, records0, took0), (error1, _, _) = ex.run(_only_rank_zero_submits, args=["lonely", cached_steps])
    assert error1 is None
    assert error0 is not None and "'lonely'" in error0 and "[1]" in error0 and "stall_shutdown_s" in error0
    assert 1.5 < took0 < 10
    # who waits for whom: rank 0 submitted it, rank 1 is missing
    assert any("'lonely'" in m and "for rank(s) [1]" in m and "(ranks [0] submitted it)" in m for m in records0), records0


def _each_rank_its_own_name(cached_first: bool = False, late_rank_sleeps_s: float = 0.0):
    """Rank r allreduces 'grad.r': alive, but never the same op as its peer (a desync, not a leaver).
    With ``late_rank_sleeps_s``, rank 1 instead sleeps (in its own code, not in hvdray) and then submits
    rank 0's op: late, not deadlocked."""
    import torch

    import hvdray.torch as hvd

    hvd.init()
    if cached_first:  # both names cached on both ranks: announced by flag bits, not by name
        for _ in range(3):
            hvd.allreduce(torch.ones(2), name="grad.0")
            hvd.allreduce(torch.ones(2), name="grad.1")
    started = time.monotonic()
    name = f"grad.{hvd.rank()}"
    if late_rank_sleeps_s and hvd.rank() == 1:
        time.sleep(late_rank_sleeps_s)
        name = "grad.0"
    try:
        hvd.allreduce(torch.ones(2), name=name)
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return f"{type(exc).__name__}: {exc}", time.monotonic() - started
    return None, time.monotonic() - started


def test_ranks_waiting_on_different_names_both_fail_naming_the_other_rank(make_executor):
    settings = RayExecutor.create_settings(timeout_s=20, stall_warning_s=1, stall_shutdown_s=2)
    ex = make_executor(settings=settings, num_workers=2)
    (error0, took0), (error1, took1) = ex.run(_each_rank_its_own_name)
    assert error0 is not None and "'grad.0'" in error0 and "[1]" in error0, error0
    assert error1 is not None and "'grad.1'" in error1 and "[0]" in error1, error1
    assert took0 < 10 and took1 < 10


@pytest.mark.parametrize("cached_first", [False, True], ids=["negotiated-by-name", "cached"])
def test_a_deadlock_fails_after_the_warning_time_even_without_a_shutdown_bound(make_executor, cached_first):
    settings = RayExecutor.create_settings(timeout_s=20, stall_warning_s=2, stall_shutdown_s=0)
    ex = make_executor(settings=settings, num_workers=2)
    (error0, took0), (error1, took1) = ex.run(_each_rank_its_own_name, args=[cached_first])
    for error, mine, other in ((error0, "'grad.0'", "[1]"), (error1, "'grad.1'", "[0]")):
        assert error is not None and mine in error and other in error and "deadlock" in error, error
    assert 1.5 < took0 < 15 and 1.5 < took1 < 15, (took0, took1)


def test_a_rank_late_in_its_own_code_is_waited_for_not_failed(make_executor):
    settings = RayExecutor.create_settings(timeout_s=20, stall_warning_s=1, stall_shutdown_s=0)
    ex = make_executor(settings=settings, num_workers=2)
    (error0, took0), (error1, _) = ex.run(_each_rank_its_own_name, kwargs={"late_rank_sleeps_s": 3.0})
    assert error0 is None and error1 is None, (error0, error1)
    assert took0 >= 2.5  # rank 0 did wait, past the warning, and was not failed
