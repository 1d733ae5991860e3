"""Ray Data in executor runs: ``run(fn, datasets={...})`` and ``hvdray.get_dataset_shard(name)`` on real
workers, fixed and elastic (a reset re-splits over the new workers), and the errors for bad input."""

from __future__ import annotations

import os

import pytest
import ray

from hvdray import RayExecutor


def _settings(**kwargs):
    return RayExecutor.create_settings(timeout_s=20, placement_group_timeout_s=60, **kwargs)


def _shard_ids(passes: int = 1) -> dict:
    """Every id this rank reads from its ``train`` shard, per pass."""
    import hvdray
    import hvdray.torch as hvd

    hvd.init()
    shard = hvdray.get_dataset_shard("train")
    seen = [[int(i) for batch in shard.iter_batches(batch_size=7) for i in batch["id"]] for _ in range(passes)]
    return {"rank": hvd.rank(), "passes": seen, "has_eval": "eval" in _names()}


def _names() -> list[str]:
    import hvdray

    try:
        hvdray.get_dataset_shard("eval")
        return ["eval"]
    except KeyError:
        return []


def test_each_rank_reads_an_equal_disjoint_shard_every_pass(make_executor):
    executor = make_executor(num_workers=2)
    results = executor.run(_shard_ids, args=[2], datasets={"train": ray.data.range(100, override_num_blocks=10)})
    assert [r["rank"] for r in results] == [0, 1]
    for passes in zip(*(r["passes"] for r in results)):  # one pass of every rank
        assert [len(ids) for ids in passes] == [50, 50]
        assert sorted(passes[0] + passes[1]) == list(range(100))
    # a later call gets its own split of its own datasets (101 rows: equal=True drops the odd one)
    again = executor.run(_shard_ids, datasets={"train": ray.data.range(101), "eval": ray.data.range(4)})
    assert [len(r["passes"][0]) for r in again] == [50, 50] and all(r["has_eval"] for r in again)
    assert len(set(again[0]["passes"][0]) | set(again[1]["passes"][0])) == 100


def _shard_error(name):
    import hvdray

    try:
        hvdray.get_dataset_shard(name)
    except (KeyError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _pid_and_rows(rank_raises=None):
    import os

    import hvdray
    import hvdray.torch as hvd

    hvd.init()
    shard = hvdray.get_dataset_shard("train")
    if hvd.rank() == rank_raises:
        raise ValueError(f"rank {rank_raises} gives up")
    rows = 0
    for _ in range(2):  # the second pass waits for every rank: the one that raised never comes
        rows += sum(len(batch["id"]) for batch in shard.iter_batches(batch_size=8))
    return os.getpid(), rows


def test_a_rank_that_raises_releases_its_peers_from_their_shards_and_the_workers_stay(make_executor):
    """A rank raises while its peer reads its shard: the driver ends the split, the peer's read fails
    instead of waiting for the rank that raised, and the next call (a new split) takes the same workers."""
    executor = make_executor(num_workers=2)
    ds = ray.data.range(64)
    pids = [pid for pid, _ in executor.run(_pid_and_rows, datasets={"train": ds})]
    with pytest.raises(ValueError, match="rank 1 gives up"):
        executor.run(_pid_and_rows, args=[1], datasets={"train": ds})
    assert executor.run(_pid_and_rows, datasets={"train": ds}) == [(pid, 64) for pid in pids]


def test_bad_datasets_and_names_are_refused_naming_them(make_executor):
    executor = make_executor(num_workers=2)
    with pytest.raises(TypeError, match=r"datasets\['train'\] must be a ray.data.Dataset, got list"):
        executor.run(_shard_error, args=["train"], datasets={"train": [1, 2, 3]})
    with pytest.raises(TypeError, match="datasets must be a dict"):
        executor.run(_shard_error, args=["train"], datasets=[ray.data.range(3)])
    errors = executor.run(_shard_error, args=["valid"], datasets={"train": ray.data.range(4)})
    assert all("name 'valid' is not a dataset of this run; the datasets are ['train']" in e for e in errors), errors
    errors = executor.run(_shard_error, args=["train"])  # no datasets in this call
    assert all("no datasets were passed to this run" in e for e in errors), errors
    assert executor.run(_shard_error, args=[3], datasets={"train": ray.data.range(4)})[0].startswith(
        "TypeError: name must be")
    with pytest.raises(TypeError, match="dataset_config must be a ray.train.DataConfig"):
        RayExecutor(_settings(), num_workers=1, dataset_config={"train": "split"})


class _ShrinkingDiscovery:
    """This node with 2 slots, then 1 once the marker file exists (so the dead worker is not replaced)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        return {ray.get_runtime_context().get_node_id(): 1 if os.path.exists(self.marker) else 2}


def _elastic_passes(marker: str) -> list:
    import os

    import torch

    import hvdray
    import hvdray.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    state = hvd.elastic.ObjectState(epoch=0, seen=[])

    @hvd.elastic.run
    def train(state):
        while state.epoch < 3:
            shard = hvdray.get_dataset_shard("train")  # inside the wrapped function: the current epoch's split
            ids = [int(i) for batch in shard.iter_batches(batch_size=8) for i in batch["id"]]
            if state.epoch == 1 and hvd.rank() == 1 and not os.path.exists(marker):  # dies after its pass
                open(marker, "w").close()
                os._exit(1)
            every = hvd.allgather_object(sorted(ids))  # rank 0's fails: it rolls back to the commit of epoch 0
            state.seen.append((hvd.size(), len(ids), sorted(i for part in every for i in part) == list(range(60))))
            state.epoch += 1
            state.commit()
        return state.seen

    return train(state)


def test_an_elastic_reset_splits_the_dataset_over_the_new_workers(ray_local, tmp_path):
    marker = str(tmp_path / "died")
    settings = _settings(discovery=_ShrinkingDiscovery(marker), discovery_interval_s=0.5)
    with RayExecutor(settings, min_workers=1, max_workers=2, override_discovery=False) as executor:
        results = executor.run(_elastic_passes, args=[marker], datasets={"train": ray.data.range(60)})
    assert os.path.exists(marker)
    # epoch 0 on two workers (30 rows each), rolled back after the death, then epochs 1 and 2 alone (60 rows)
    assert results == [[(2, 30, True), (1, 60, True), (1, 60, True)]], results
