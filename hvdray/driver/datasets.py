"""Ray Data for a run: ``executor.run(fn, datasets={"train": ds})`` gives every rank one equal shard.

The split is Ray Train's own (:class:`ray.train.DataConfig`: ``streaming_split(n, equal=True)`` with
the workers' nodes as locality hints). It is made once per membership epoch, after the coordinator has
given the ranks, and handed to the coordinator, where each worker's ``hvdray.get_dataset_shard(name)``
picks up its rank's iterator: an elastic reset gets a fresh split over the new number of workers.

A split ends (:func:`end_split`) when its epoch or call does, or a fault ends it: Ray Data's split
never lets go of a rank whose peer died (the pass waits at its start for every rank, and a reader
left alone is blocked once the dead rank's rows fill the executor's budget), so the driver stops it,
and whoever still reads it fails at once (see :func:`hvdray.worker.datasets.peer_failure`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence

import ray

from hvdray.worker.datasets import split_actor

if TYPE_CHECKING:
    from ray.train import DataConfig


def check_datasets(datasets: Any) -> Optional[dict[str, Any]]:
    """``datasets`` as a plain dict of name -> ``ray.data.Dataset`` (None or empty: no datasets); a bad
    value raises naming the argument and the offending entry."""
    if datasets is None:
        return None
    if not isinstance(datasets, dict):
        raise TypeError(f"datasets must be a dict of name -> ray.data.Dataset, got {type(datasets).__name__}")
    from ray.data import Dataset

    for name, dataset in datasets.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"datasets keys must be non-empty str names, got {name!r}")
        if not isinstance(dataset, Dataset):
            raise TypeError(f"datasets[{name!r}] must be a ray.data.Dataset, got {type(dataset).__name__}")
    return dict(datasets) or None


def check_data_config(data_config: Any) -> None:
    if data_config is None:
        return
    from ray.train import DataConfig

    if not isinstance(data_config, DataConfig):
        raise TypeError(f"dataset_config must be a ray.train.DataConfig, got {type(data_config).__name__}")


class DatasetSplitter:
    """The datasets of one run and how they are split: one shard per rank, made anew for each epoch."""

    def __init__(self, datasets: dict[str, Any], data_config: Optional["DataConfig"] = None) -> None:
        from ray.train import DataConfig

        self.datasets = datasets
        self._config = data_config if data_config is not None else DataConfig()

    @property
    def names(self) -> list[str]:
        return sorted(self.datasets)

    def split(self, actors: Sequence[Any], node_ids: Sequence[Optional[str]]) -> list[dict[str, Any]]:
        """One ``{name: DataIterator}`` per rank (``actors`` and ``node_ids`` in rank order)."""
        hints = list(node_ids) if all(node_ids) else None
        return self._config.configure(self.datasets, world_size=len(actors), worker_handles=list(actors),
                                      worker_node_ids=hints)


def end_split(shards: Sequence[dict[str, Any]]) -> None:
    """Stop the streaming of one split (``shards`` as :meth:`DatasetSplitter.split` made them): its
    ``SplitCoordinator`` actors are killed, with the Ray Data executors they run."""
    actors = {actor._actor_id: actor for shard in shards for it in shard.values()
              if (actor := split_actor(it)) is not None}
    for actor in actors.values():
        ray.kill(actor, no_restart=True)
