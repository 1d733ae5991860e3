"""How the worker group names a failed rank: one function for fixed runs, elastic runs and Tune trials."""

from __future__ import annotations

import pytest
import ray
import ray.cloudpickle as cloudpickle

from hvdray.driver.failures import WorkerLostError, failure_error


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


class QuotaError(Exception):
    """A user's exception whose __init__ takes other arguments than a message."""

    def __init__(self, user, limit):
        super().__init__(user, limit)
        self.user, self.limit = user, limit

    def __str__(self):
        return f"{self.user} is over the quota of {self.limit}"


@pytest.mark.parametrize("cause", [ValueError("bad batch"), KeyError("bad batch 17"), OSError(2, "no file"),
                                   QuotaError("ana", 3)], ids=lambda c: type(c).__name__)
def test_str_of_the_error_starts_with_the_rank_and_the_type_is_kept(cause):
    raised = ray.exceptions.RayTaskError("run", "Traceback (most recent call last):\n  worker frames", cause)
    error = failure_error(raised, rank=1, size=2)
    assert isinstance(error, type(cause)) and isinstance(error, ray.exceptions.RayTaskError)
    assert str(error).startswith(f"rank 1 of 2: {cause}\n"), str(error)
    assert "worker frames" in str(error)  # the worker's traceback comes along
    for name, value in vars(cause).items():
        assert getattr(error, name) == value
    copy = cloudpickle.loads(cloudpickle.dumps(error))  # how Ray and Tune move it between processes
    assert isinstance(copy, type(cause)) and str(copy) == str(error)


def test_a_plain_exception_is_prefixed_too_and_keeps_its_traceback():
    try:
        raise QuotaError("bo", 5)
    except QuotaError as exc:
        cause = exc
    error = failure_error(cause, rank=None, worker_id="cd34", aftermath="the job was stopped")
    assert type(error) is not QuotaError and isinstance(error, QuotaError)
    assert str(error) == "a worker not yet in the ring (worker cd34): bo is over the quota of 5"
    assert (error.user, error.limit, error.args) == ("bo", 5, ("bo", 5))
    assert error.__traceback__ is cause.__traceback__
    assert str(cause) == "bo is over the quota of 5"  # the original is left as it was
