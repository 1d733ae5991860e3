"""``hvdray.report(metrics, checkpoint=None)``: one result of the training function, from any worker.

The same function is ``hvdray.tune.report``. Where it goes depends on where it is called:

- inside a Tune trial (``DistributedTrainableCreator``): to Tune, as before (see ``hvdray.tune.session``);
- inside an executor's worker (``executor.run`` / ``execute``): rank 0's metrics go to the driver, where
  they reach the run's callbacks and ``executor.result``; rank 0's checkpoint is first copied to
  ``<storage_path>/checkpoint_<n>`` and the report has reached the driver's coordinator when ``report``
  returns, so a failure right after still leaves it in ``executor.result``. Other ranks' reports are dropped, as in Ray Train: call ``report``
  on every rank (same code everywhere), and only rank 0's counts;
- anywhere else (a plain process): the metrics are logged.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Callable, Optional

import ray

if TYPE_CHECKING:
    from ray.train import Checkpoint

log = logging.getLogger(__name__)


class ExecutorReports:
    """Where the reports of an executor's worker go: the job's coordinator, and storage_path for checkpoints."""

    def __init__(self, coordinator: Any, storage_path: Optional[str], track: Callable[[ray.ObjectRef], None],
                 origin: Callable[[], tuple[str, int]]) -> None:
        self._coordinator = coordinator
        self._storage_path = storage_path
        self._track = track  # the worker waits for these sends before its call returns
        self._origin = origin  # numbers this process's records in the order sent (the coordinator keeps it)

    def send(self, metrics: dict[str, Any], checkpoint: Optional["Checkpoint"]) -> None:
        if checkpoint is not None and self._storage_path is None:  # the same error on every rank
            raise ValueError(
                "report(checkpoint=...) needs a storage_path to keep checkpoints in: "
                "RayExecutor(..., storage_path='/shared/dir' or 's3://bucket/run')"
            )
        rank = int(os.environ.get("HOROVOD_RANK", "-1"))  # elastic ranks change with each epoch
        if rank != 0:
            return
        if checkpoint is None:  # metrics only: sent without waiting (the call waits for it before it ends)
            self._track(self._coordinator.push_report.remote(rank, dict(metrics), None, self._origin()))
            return
        assert self._storage_path is not None
        from hvdray.storage import persist_checkpoint  # pyarrow: imported by the workers that checkpoint

        index = ray.get(self._coordinator.next_checkpoint.remote())
        path = persist_checkpoint(checkpoint, self._storage_path, index)
        # a checkpoint's report has arrived when report returns: a failure right after keeps it in the result
        ray.get(self._coordinator.push_report.remote(rank, dict(metrics), path, self._origin()))


_sink: Optional[ExecutorReports] = None


def set_sink(sink: Optional[ExecutorReports]) -> None:
    """Where ``report`` sends results outside Tune; the worker actor installs its executor's here."""
    global _sink
    _sink = sink


def report(metrics: dict[str, Any], checkpoint: Optional["Checkpoint"] = None) -> None:
    """Report one result: a dict of metrics and, optionally, a ``ray.train.Checkpoint`` (for instance
    ``Checkpoint.from_directory(d)`` of a directory this worker wrote). Call it on every rank; rank 0's
    metrics and checkpoint are the ones kept (see the module's docstring for where they go)."""
    if not isinstance(metrics, dict):
        raise TypeError(f"report takes a dict of metrics, got {type(metrics).__name__}")
    if checkpoint is not None:
        # ray.train (pyarrow, pandas: ~0.55 s of CPU) only where a checkpoint comes, which imported it already
        from ray.train import Checkpoint  # ray.tune.Checkpoint is a subclass

        if not isinstance(checkpoint, Checkpoint):
            raise TypeError(f"checkpoint must be a ray.train.Checkpoint, got {type(checkpoint).__name__}")
    from hvdray.tune import session as trial

    if trial.in_trial():
        trial.report_to_trial(metrics, checkpoint)
    elif _sink is not None:
        _sink.send(metrics, checkpoint)
    else:
        log.info("report outside an executor: %s", ", ".join(f"{k}={v}" for k, v in metrics.items()))
