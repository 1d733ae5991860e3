"""The worker's collective state as one :class:`Session` object: lifecycle, generations, elastic epochs,
the process-set registry and shutdown hooks, on size-1 jobs (no Ray)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import hvdray.torch as hvd
from hvdray.collective import session
from hvdray.collective.errors import HvdrayError, NotInitializedError
from hvdray.collective.topology import RankInfo

ONE = RankInfo(rank=0, size=1, local_rank=0, local_size=1, cross_rank=0, cross_size=1)


class _Membership:
    """An elastic membership whose every next epoch is a size-1 epoch one later."""

    def __init__(self) -> None:
        self.asked: list[int] = []

    def next_epoch(self, left_epoch: int) -> tuple[int, RankInfo]:
        self.asked.append(left_epoch)
        return left_epoch + 1, ONE

    def host_updates(self) -> int:
        return 3


@pytest.fixture
def fresh():
    """A session of its own, beside the process's, shut down after the test."""
    made = session.Session()
    yield made
    made.shutdown()


def test_the_module_functions_act_on_the_process_session():
    hvd.init()
    try:
        assert session.current().engine is session.engine()
        assert session.engines() == [session.current().engine]
        assert session.rank_info("test") is session.current().current_job().rank_info
        assert session.host_updates() == 0  # not an elastic job
    finally:
        hvd.shutdown()
    assert session.current().engine is None and not session.is_initialized()
    with pytest.raises(NotInitializedError):
        session.engine("test")


def test_inits_count_generations_within_an_epoch(fresh):
    fresh.init()
    first = fresh.engine
    assert (fresh.generation, fresh._store_prefix()) == (1, "e1/gen1/")
    fresh.init()  # a no-op while running
    assert fresh.engine is first and fresh.generation == 1
    fresh.shutdown()
    assert fresh.engine is None and fresh.engines() == []
    fresh.init()
    assert (fresh.generation, fresh._store_prefix()) == (2, "e1/gen2/")
    assert fresh.engine is not first and fresh.engine.alive


def test_an_elastic_reset_joins_the_next_epoch_and_counts_from_one(fresh):
    membership = _Membership()
    job = dataclasses.replace(session.single_process_job(), rank_info=None, membership=membership)
    fresh.configure(job)
    fresh.init()
    assert (job.epoch, fresh.generation, membership.asked) == (2, 1, [1])
    fresh.shutdown()
    fresh.init()  # the same epoch: rank kept, next generation
    assert (job.epoch, fresh.generation, membership.asked) == (2, 2, [1])
    fresh.reset()
    assert (job.epoch, fresh.generation, membership.asked) == (3, 1, [1, 2])
    assert fresh.engine is not None and fresh.engine.alive


def test_a_reset_without_membership_says_the_job_is_not_elastic(fresh):
    fresh.init()
    with pytest.raises(HvdrayError, match="not elastic"):
        fresh.reset()
    assert fresh.engine is None


def test_configuring_another_job_stops_the_running_engine(fresh):
    job = session.single_process_job()
    fresh.configure(job)
    fresh.init()
    running = fresh.engine
    fresh.configure(job)  # the same job: kept
    assert fresh.engine is running
    fresh.configure(session.single_process_job())
    assert fresh.engine is None and not running.alive


def test_a_session_starts_and_stops_its_own_timeline(fresh, tmp_path):
    with pytest.raises(NotInitializedError):
        fresh.start_timeline(str(tmp_path / "t.json"))
    fresh.init()
    fresh.start_timeline(str(tmp_path / "t.json"))
    assert fresh.engine.timeline is fresh.timeline is not None
    fresh.shutdown()
    assert fresh.timeline is None and (tmp_path / "t.json").exists()


def test_shutdown_forgets_the_process_sets():
    try:
        hvd.init()
        ps = hvd.add_process_set([0])
        assert ps.process_set_id == 1 and session.current().process_sets.sets == {1: ps}
        assert torch.equal(hvd.allreduce(torch.ones(2), process_set=ps), torch.ones(2))
        hvd.shutdown()
        assert ps.process_set_id is None and session.current().process_sets.sets == {}
        hvd.init()
        assert hvd.add_process_set([0]).process_set_id == 1  # ids count from 1 again
    finally:
        hvd.shutdown()
