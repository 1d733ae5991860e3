"""How the worker group names a failed rank: one function for fixed runs, elastic runs and Tune trials."""

from __future__ import annotations

import ray

from hvdray.driver.worker_group import WorkerLostError, failure_error


def test_a_users_exception_comes_back_as_itself_with_one_note_on_it_and_on_rays_copy():
    cause = KeyError("bad batch 17")
    error = failure_error(ray.exceptions.RayTaskError("run", "traceback", cause), rank=1, size=2)
    note = "hvdray: raised on rank 1 of 2; the other workers were stopped"
    assert isinstance(error, KeyError)
    assert error.__notes__ == [note] and cause.__notes__ == [note]


def test_an_elastic_worker_is_named_by_rank_or_as_not_yet_in_the_ring():
    in_ring = failure_error(ValueError("x"), rank=3, worker_id="ab12", aftermath="the job was stopped")
    assert in_ring.__notes__ == ["hvdray: raised on rank 3 (worker ab12); the job was stopped"]
    waiting = failure_error(ValueError("y"), rank=None, worker_id="cd34", aftermath="the job was stopped")
    assert waiting.__notes__ == ["hvdray: raised on a worker not yet in the ring (worker cd34); the job was stopped"]


def test_a_dead_worker_becomes_a_worker_lost_error_naming_its_rank():
    died = ray.exceptions.RayActorError()
    error = failure_error(died, rank=0, size=4)
    assert isinstance(error, WorkerLostError) and str(error).startswith("the worker of rank 0 (of 4) died")
    assert error.__cause__ is died and error.__suppress_context__
