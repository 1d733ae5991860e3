"""A worker lost in the middle of a Ray Data pass, on real Ray Data: its peers, blocked in ``iter_batches``,
are released within a bound. A fixed-size job fails naming the lost rank; an elastic job rolls back to its
last commit and reads the repeated pass over the survivors' new split.

Why the peers block: the split (``streaming_split(n, equal=True)``) starts a pass only when every rank has
asked for it, and a rank left alone mid-pass waits once the dead rank's undelivered rows fill the Ray Data
executor's memory budget. The tests set that budget small (``DataConfig(execution_options=...)``) so that
the survivor blocks after a few blocks, as it would with a large dataset."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest
import ray
import ray.cloudpickle
from ray._private.state import actors as gcs_actors
from ray.data import ExecutionOptions, ExecutionResources
from ray.train import DataConfig

from hvdray import RayExecutor
from hvdray.driver.failures import WorkerLostError

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

ROWS = 800  # 40 blocks of 20 rows of 16 KB: 12.8 MB in all, six times the executor's budget
BUDGET = DataConfig(execution_options=ExecutionOptions(resource_limits=ExecutionResources(object_store_memory=2e6)))


def _padded_rows():
    import numpy as np

    def pad(batch):
        batch["pad"] = np.zeros((len(batch["id"]), 2048), dtype=np.float64)
        return batch

    return ray.data.range(ROWS, override_num_blocks=40).map_batches(pad)


def _alive_split_coordinators() -> list[str]:
    return [a["ActorID"] for a in gcs_actors().values()
            if a["State"] == "ALIVE" and a["ActorClassName"].endswith("SplitCoordinator")]


def _wait_no_split_coordinator(seconds: float = 15.0) -> None:
    deadline = time.monotonic() + seconds
    while _alive_split_coordinators() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive_split_coordinators(), "a SplitCoordinator outlived its run"


def _write(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def _die_once_rank0_stalls(progress: str, died: str) -> None:
    """Rank 1, after its first batch: wait (reading nothing more) until rank 0's progress has stood still
    for 3 s, i.e. rank 0 is blocked in ``iter_batches``, then die as a crash would, noting when and the
    progress it saw."""
    import json
    import os
    import time

    last, still_since = None, time.monotonic()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        now = open(progress).read() if os.path.exists(progress) else None
        if now != last:
            last, still_since = now, time.monotonic()
        elif now is not None and time.monotonic() - still_since > 3:
            break
        time.sleep(0.1)
    _write(died, json.dumps({"at": time.time(), "progress": last}))
    os._exit(1)


def _rank1_dies_mid_pass(progress: str, died: str):
    import torch

    import hvdray
    import hvdray.torch as hvd
    from hvdray import ray_logger

    torch.set_num_threads(1)
    hvd.init()
    rows = 0
    for batch in hvdray.get_dataset_shard("train").iter_batches(batch_size=20):
        rows += len(batch["id"])
        if hvd.rank() == 1:
            _die_once_rank0_stalls(progress, died)
        _write(progress, str(rows))
    ray_logger.log({"kind": "pass_done", "rows": rows})
    return rows


def test_a_fixed_job_fails_naming_the_rank_lost_mid_pass(make_executor, tmp_path):
    progress, died = str(tmp_path / "progress"), str(tmp_path / "died")
    executor = make_executor(num_workers=2, dataset_config=BUDGET)
    records = []
    with pytest.raises(WorkerLostError, match=r"the worker of rank 1 \(of 2\) died"):
        executor.run(_rank1_dies_mid_pass, args=[progress, died], datasets={"train": _padded_rows()},
                     callbacks=[records.append])
    raised = time.time()
    death = json.loads(open(died).read())
    # rank 0 had read part of its 400 rows and stood blocked in iter_batches when rank 1 died: it never finished
    assert 0 < int(death["progress"]) < ROWS // 2 and open(progress).read() == death["progress"], death
    assert not any(r.get("kind") == "pass_done" for r in records), records
    assert raised - death["at"] < 15, "the run took too long to fail after the death"
    _wait_no_split_coordinator()


class _ShrinkingDiscovery:
    """This node with 2 slots, then 1 once the marker file exists (so the dead worker is not replaced)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        return {ray.get_runtime_context().get_node_id(): 1 if os.path.exists(self.marker) else 2}


def _elastic_passes(marker: str, when: str, progress: str) -> list:
    import os

    import torch

    import hvdray
    import hvdray.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    state = hvd.elastic.ObjectState(epoch=0, seen=[])

    def dies_now() -> bool:
        if state.epoch == 1 and hvd.rank() == 1 and not os.path.exists(marker):
            open(marker, "w").close()
            return True
        return False

    @hvd.elastic.run
    def train(state):
        while state.epoch < 3:
            shard = hvdray.get_dataset_shard("train")  # inside the wrapped function: the current epoch's split
            if when == "before_its_pass" and dies_now():
                os._exit(1)  # rank 0 waits at the start of the pass for it
            ids = []
            for batch in shard.iter_batches(batch_size=20):
                ids += [int(i) for i in batch["id"]]
                if when == "mid_pass" and dies_now():
                    _die_once_rank0_stalls(progress, marker + ".at")  # rank 0 is blocked in iter_batches
                if hvd.rank() == 0:
                    _write(progress, f"{state.epoch}:{len(ids)}")
            every = hvd.allgather_object(sorted(ids))
            state.seen.append((hvd.size(), len(ids), sorted(i for part in every for i in part) == list(range(ROWS))))
            state.epoch += 1
            state.commit()
        return state.seen

    return train(state)


@pytest.mark.parametrize("when", ["mid_pass", "before_its_pass"])
def test_an_elastic_job_recovers_from_a_rank_lost_during_a_pass(ray_local, tmp_path, when):
    marker = str(tmp_path / "died")
    settings = RayExecutor.create_settings(timeout_s=20, placement_group_timeout_s=60,
                                           discovery=_ShrinkingDiscovery(marker), discovery_interval_s=0.5)
    transitions = []
    started = time.monotonic()
    with RayExecutor(settings, min_workers=1, max_workers=2, override_discovery=False,
                     dataset_config=BUDGET) as executor:
        results = executor.run(_elastic_passes, args=[marker, when, str(tmp_path / "progress")],
                               datasets={"train": _padded_rows()},
                               callbacks=[lambda r: r.get("event") == "elastic" and transitions.append(r)])
    elapsed = time.monotonic() - started
    assert os.path.exists(marker)
    if when == "mid_pass":  # rank 0 stood blocked in the pass of epoch 1, part of its 400 rows read
        epoch, rows = json.loads(open(marker + ".at").read())["progress"].split(":")
        assert epoch == "1" and 0 < int(rows) < ROWS // 2, (epoch, rows)
    # epoch 0 on two workers (400 rows each); rank 0, blocked in epoch 1's pass, was released and rolled back
    # to the commit of epoch 0, then read epochs 1 and 2 alone (all 800 rows), long before elastic_timeout
    assert results == [[(2, ROWS // 2, True), (1, ROWS, True), (1, ROWS, True)]], results
    assert [t["state"] for t in transitions].count("recovering") == 1, transitions
    assert elapsed < 60, f"took {elapsed:.0f} s"
    _wait_no_split_coordinator()


def _shard_fetched_outside_the_wrapped_function(marker: str) -> list:
    import os

    import torch

    import hvdray
    import hvdray.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    shard = hvdray.get_dataset_shard("train")  # the first epoch's split, kept across resets: the mistake
    state = hvd.elastic.ObjectState(epoch=0)

    @hvd.elastic.run
    def train(state):
        while state.epoch < 2:
            for _ in shard.iter_batches(batch_size=20):
                if hvd.rank() == 1 and not os.path.exists(marker):
                    open(marker, "w").close()
                    os._exit(1)
            state.epoch += 1
            state.commit()

    return train(state)


def test_a_shard_of_an_ended_epoch_read_after_a_reset_fails_saying_where_to_fetch_it(ray_local, tmp_path):
    marker = str(tmp_path / "died")
    settings = RayExecutor.create_settings(timeout_s=20, placement_group_timeout_s=60,
                                           discovery=_ShrinkingDiscovery(marker), discovery_interval_s=0.5)
    started = time.monotonic()
    with RayExecutor(settings, min_workers=1, max_workers=2, override_discovery=False,
                     dataset_config=BUDGET) as executor:
        with pytest.raises(RuntimeError, match=r"rank 0.*a dataset shard of membership epoch 1 was read in epoch 2"
                                               r".*inside the function hvd.elastic.run wraps"):
            executor.run(_shard_fetched_outside_the_wrapped_function, args=[marker],
                         datasets={"train": _padded_rows()})
    assert time.monotonic() - started < 60
    _wait_no_split_coordinator()
