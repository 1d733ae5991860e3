"""``hvdray.get_dataset_shard(name)``: this rank's shard of a Ray Dataset passed to ``executor.run``.

The driver splits each dataset once per membership epoch (:mod:`hvdray.driver.datasets`) and leaves
the shards with the job's coordinator; a worker fetches its rank's on first use in each epoch. In an
elastic job, call it inside the function ``hvd.elastic.run`` wraps: after a reset it returns the new
epoch's shard, split over the new number of workers.

When an epoch ends on a fault, the driver stops its split (:func:`split_actor`): a rank still reading
its shard, blocked for rows that no longer come or for a dead peer at the start of a pass, gets an
``ActorDiedError`` from Ray Data, which :func:`peer_failure` turns into the rollback it calls for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import ray

from hvdray.collective.errors import HorovodInternalError

if TYPE_CHECKING:
    from ray.data import DataIterator


class ShardSource:
    """Where an executor's worker gets its shards: the job's coordinator, cached for the current epoch."""

    def __init__(self, coordinator: Any, timeout_s: float) -> None:
        self._coordinator = coordinator
        self._timeout_s = timeout_s
        self._cached: Optional[tuple[int, int, int, dict[str, Any]]] = None  # (call, epoch, rank, shards)
        self._split_epochs: dict[str, int] = {}  # split actor id (hex) -> the epoch whose shards it streams

    def shards(self) -> dict[str, Any]:
        """This rank's ``{name: DataIterator}`` for the running call and epoch ({} without datasets)."""
        from hvdray.collective import session  # here: the driver imports this module, and needs no torch

        current = session.current()
        job = current.current_job()
        if job.rank_info is None:
            raise RuntimeError(
                "get_dataset_shard in an elastic job needs a rank: call hvd.init() first (and call "
                "get_dataset_shard inside the function hvd.elastic.run wraps, so a reset gets the new split)"
            )
        key = (current.call, job.epoch, job.rank_info.rank)
        if self._cached is not None and self._cached[:3] == key:
            return self._cached[3]
        status, shards = ray.get(self._coordinator.dataset_shard.remote(*key, self._timeout_s))
        if status == "superseded":  # an elastic reset is under way: hvd.elastic.run rolls back and re-forms
            raise HorovodInternalError(f"membership epoch {job.epoch} ended before its dataset shards were handed out")
        if status == "timeout":
            raise TimeoutError(f"the driver did not hand out the dataset shards of epoch {job.epoch} "
                               f"within timeout_s={self._timeout_s} s")
        shards = shards if status == "ok" else {}
        self._cached = (*key, shards)
        for iterator in shards.values():
            actor = split_actor(iterator)
            if actor is not None:
                self._split_epochs[actor._actor_id.hex()] = job.epoch
        return shards

    def peer_failure(self, exc: BaseException) -> Optional[HorovodInternalError]:
        """See :func:`peer_failure`."""
        dead = getattr(exc, "actor_id", None) if isinstance(exc, ray.exceptions.RayActorError) else None
        epoch = self._split_epochs.get(dead) if dead is not None else None
        if epoch is None:
            return None
        from hvdray.collective import session

        current = session.current().current_job().epoch
        if epoch != current:
            raise RuntimeError(
                f"a dataset shard of membership epoch {epoch} was read in epoch {current}: its split ended with "
                "that epoch. Call hvdray.get_dataset_shard inside the function hvd.elastic.run wraps, so that "
                "each try after a reset reads the new epoch's shard"
            ) from exc
        return HorovodInternalError(
            f"the dataset split of membership epoch {epoch} was stopped: the epoch ended on a peer's failure")


def split_actor(iterator: Any) -> Optional[Any]:
    """The Ray Data ``SplitCoordinator`` actor that streams a split dataset's rows to the ranks, or None
    for a dataset every rank reads whole. Ray offers no public handle on it (nor a way to stop a
    ``streaming_split``); its ``StreamSplitDataIterator`` keeps it as ``_coord_actor``."""
    return getattr(iterator, "_coord_actor", None)


_source: Optional[ShardSource] = None


def set_source(source: Optional[ShardSource]) -> None:
    """The worker actor installs its job's shard source here when it is configured."""
    global _source
    _source = source


def peer_failure(exc: BaseException) -> Optional[HorovodInternalError]:
    """For ``hvd.elastic.run``: the peer failure behind ``exc`` when it is the death of the split actor of
    this rank's shard in its current epoch (the driver stopped that epoch's split on a fault), else
    None. A shard of an earlier epoch, read after a reset, raises ``RuntimeError`` saying where to call
    ``get_dataset_shard``."""
    return _source.peer_failure(exc) if _source is not None else None


def get_dataset_shard(name: str) -> "DataIterator":
    """This rank's ``ray.data.DataIterator`` over dataset ``name`` of ``executor.run(fn, datasets={...})``:
    an equal share of the rows (``streaming_split(size, equal=True)``), one pass per ``iter_batches()``
    / ``iter_torch_batches()``. Every rank must iterate its shard the same number of times."""
    if not isinstance(name, str):
        raise TypeError(f"name must be the str key of a dataset passed to run(datasets=...), got {type(name).__name__}")
    if _source is None:
        raise RuntimeError("get_dataset_shard works inside a function run by RayExecutor.run(fn, datasets=...)")
    shards = _source.shards()
    if not shards:
        raise KeyError(f"name {name!r}: no datasets were passed to this run; use executor.run(fn, datasets={{...}})")
    if name not in shards:
        raise KeyError(f"name {name!r} is not a dataset of this run; the datasets are {sorted(shards)}")
    return shards[name]
