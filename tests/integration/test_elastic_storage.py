"""Committed elastic state outlives the workers: ``storage_path`` keeps every commit in storage.

* ``CommitStorage`` on its own: whole commits only (a partial write is never read), the newest two kept,
  local paths and ``file://`` URIs alike, a path that is a file refused by name;
* a job whose every worker dies after its second commit resumes, in new workers, from that commit;
* a new job (a restarted driver) on the same path resumes from the last commit of the one before.
"""

from __future__ import annotations

import os
import pickle
import sys

import pytest
import ray.cloudpickle

from hvdray import RayExecutor
from hvdray.elastic.storage import CommitStorage

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


# -- the storage itself -----------------------------------------------------------------------------
@pytest.mark.parametrize("as_uri", [False, True], ids=["path", "file-uri"])
def test_commits_are_read_whole_and_only_the_newest_two_are_kept(tmp_path, as_uri):
    where = tmp_path / "run"
    storage = CommitStorage(f"file://{where}" if as_uri else str(where))
    assert storage.latest() is None  # nothing there yet (the directory does not exist)
    for n in range(1, 5):
        storage.write(n, {"epoch": n})
    assert storage.latest() == (4, {"epoch": 4})
    assert sorted(os.listdir(where / "elastic_state")) == ["commit-3.pkl", "commit-4.pkl"]
    # a writer that died mid-write leaves a partial file: it is never read
    (where / "elastic_state" / ".commit-5.pkl.partial").write_bytes(pickle.dumps({"epoch": 5})[:7])
    assert storage.latest() == (4, {"epoch": 4})


def test_a_storage_path_that_is_a_file_is_refused_by_name(tmp_path):
    (tmp_path / "taken").mkdir()
    blocker = tmp_path / "taken" / "elastic_state"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="storage_path .*taken.* not a directory"):
        CommitStorage(str(tmp_path / "taken")).latest()
    with pytest.raises(ValueError, match="storage_path"):
        CommitStorage("")


# -- real elastic jobs --------------------------------------------------------------------------------
def _train(until: int, die_after: int, marker: str) -> dict:
    """Count epochs with a model; every rank dies right after commit ``die_after`` the first time through."""
    import torch

    import hvdray.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    model = torch.nn.Linear(2, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    state = hvd.elastic.TorchState(model, optimizer, epoch=0, seen=[])

    @hvd.elastic.run
    def train(state):
        started_at = state.epoch
        while state.epoch < until:
            optimizer.zero_grad()
            model.weight.grad = torch.ones_like(model.weight)  # each epoch moves every weight by -1
            hvd.allreduce_(model.weight.grad, name="grad")
            optimizer.step()
            state.epoch += 1
            state.seen = state.seen + [state.epoch]
            state.commit()
            if state.epoch == die_after and not os.path.exists(marker):
                hvd.barrier()  # every rank has committed (rank 0 wrote it) before any dies
                open(marker + f".{hvd.rank()}", "w").close()
                if hvd.rank() == 0:
                    open(marker, "w").close()
                os._exit(1)
        return {"started_at": started_at, "seen": state.seen, "weight": model.weight.sum().item()}

    return train(state)


def _elastic(storage: str, **kwargs) -> RayExecutor:
    settings = RayExecutor.create_settings(
        timeout_s=20, placement_group_timeout_s=60, discovery_interval_s=0.5, elastic_timeout=120,
        storage_path=storage, **kwargs,
    )
    # one node here: it comes back from the blacklist after a second, so replacements can start on it
    return RayExecutor(settings, min_workers=2, max_workers=2, cooldown_range=(1, 2))


def test_a_job_whose_every_worker_died_resumes_from_its_last_commit(ray_local, tmp_path):
    marker = str(tmp_path / "died")
    with _elastic(str(tmp_path / "state")) as executor:
        results = executor.run(_train, args=[4, 2, marker])
    assert os.path.exists(marker + ".0") and os.path.exists(marker + ".1")  # both ranks did die
    for result in results:
        assert result["started_at"] == 2, result  # new workers, state from storage: nothing lost
        assert result["seen"] == [1, 2, 3, 4] and result["weight"] == -8.0, result


def test_a_new_job_on_the_same_storage_path_resumes_where_the_last_one_committed(ray_local, tmp_path):
    storage = str(tmp_path / "state")
    with _elastic(storage) as executor:
        first = executor.run(_train, args=[3, 0, str(tmp_path / "unused")])
    assert [r["started_at"] for r in first] == [0, 0]
    with _elastic(storage) as executor:  # the driver "restarted": a new executor, new workers
        second = executor.run(_train, args=[5, 0, str(tmp_path / "unused")])
    for result in second:
        assert result["started_at"] == 3 and result["seen"] == [1, 2, 3, 4, 5] and result["weight"] == -10.0
