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
    assert any("'lonely'" in m and "[1]" in m for m in records0)


def _each_rank_its_own_name():
    """Rank r allreduces 'grad.r': alive, but never the same op as its peer (a desync, not a leaver)."""
    import torch

    import hvdray.torch as hvd

    hvd.init()
    started = time.monotonic()
    try:
        hvd.allreduce(torch.ones(2), name=f"grad.{hvd.rank()}")
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
