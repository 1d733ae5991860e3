"""Committed elastic state outlives the workers: ``storage_path`` keeps every commit in storage.

* ``CommitStorage`` on its own: whole commits only (a partial write is never read), the newest two kept,
  local paths and ``file://`` URIs alike, a path that is a file refused by name;
* a job whose every worker dies after its second commit resumes, in new workers, from that commit;
* a new job (a restarted driver) on the same path resumes from the last commit of the one before, in
  the same process and in a new driver process after the last one was killed with SIGKILL.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
from pathlib import Path
from typing import Optional

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
def _train(until: Optional[int], die_after: int = 0, marker: str = "", epochs_dir: Optional[str] = None,
           more: Optional[int] = None) -> dict:
    """Count epochs with a model, committing each. Every rank dies right after commit ``die_after`` the
    first time through (0: never). ``until``: the last epoch (None: no last one); ``more``: stop that many
    epochs after the one it resumed from; ``epochs_dir``: rank 0 marks each committed epoch there (a file
    named by its number), one epoch per 0.3 s."""
    import time

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
        while (until is None or state.epoch < until) and (more is None or state.epoch < started_at + more):
            optimizer.zero_grad()
            model.weight.grad = torch.ones_like(model.weight)  # each epoch moves every weight by -1
            hvd.allreduce_(model.weight.grad, name="grad")
            optimizer.step()
            state.epoch += 1
            state.seen = state.seen + [state.epoch]
            state.commit()
            if epochs_dir is not None:
                if hvd.rank() == 0:
                    open(os.path.join(epochs_dir, str(state.epoch)), "w").close()
                time.sleep(0.3)
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


_DRIVER = """
import json, sys
import ray
from hvdray import RayExecutor

address, storage, epochs_dir, more, here = sys.argv[1:6]
sys.path.insert(0, here)
from test_elastic_storage import _train

ray.init(address=address, log_to_driver=False)
settings = RayExecutor.create_settings(timeout_s=20, placement_group_timeout_s=60, discovery_interval_s=0.5,
                                       elastic_timeout=120, storage_path=storage)
with RayExecutor(settings, min_workers=2, max_workers=2) as executor:
    more = None if more == "forever" else int(more)
    results = executor.run(_train, args=[None], kwargs={"epochs_dir": epochs_dir, "more": more})
print("RESULTS " + json.dumps(results), flush=True)
"""


def test_a_new_driver_process_resumes_after_the_last_one_was_killed(tmp_path):
    """A driver process is killed (SIGKILL: no shutdown, no last commit) in the middle of an elastic job;
    a new driver process, on the same cluster and ``storage_path``, resumes from the last commit: no
    epoch lost or applied twice."""
    import signal
    import subprocess
    import time

    from ray.cluster_utils import Cluster

    storage, epochs_dir = tmp_path / "state", tmp_path / "epochs"
    epochs_dir.mkdir()
    script = tmp_path / "driver.py"
    script.write_text(_DRIVER)
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [root, os.environ.get("PYTHONPATH")] if p))
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4})
    try:
        here = str(Path(__file__).parent)
        first = subprocess.Popen([sys.executable, str(script), cluster.address, str(storage), str(epochs_dir),
                                  "forever", here], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 180
        while len(os.listdir(epochs_dir)) < 3 and time.monotonic() < deadline and first.poll() is None:
            time.sleep(0.2)
        assert len(os.listdir(epochs_dir)) >= 3, f"the first driver committed {os.listdir(epochs_dir)}"
        first.send_signal(signal.SIGKILL)
        first.wait(30)
        committed = max(int(name) for name in os.listdir(epochs_dir))
        second = subprocess.run([sys.executable, str(script), cluster.address, str(storage), str(epochs_dir), "2",
                                 here], env=env, capture_output=True, text=True, timeout=240)
        assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
        results = json.loads(second.stdout.split("RESULTS ", 1)[1].splitlines()[0])
    finally:
        cluster.shutdown()
    for result in results:
        # the commit rank 0 made last (its marker follows the commit; the kill may come between the two)
        assert result["started_at"] in (committed, committed + 1), (result, committed)
        end = result["started_at"] + 2
        assert result["seen"] == list(range(1, end + 1)) and result["weight"] == -2.0 * end, result
