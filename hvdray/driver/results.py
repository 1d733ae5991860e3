"""The result of one ``executor.run`` (or ``execute``): rank 0's reports as a ``ray.train.Result``.

Workers call ``hvdray.report(metrics, checkpoint=...)``; rank 0's reports reach the driver in order
(see ``hvdray.worker.reporting``), each with the path of the checkpoint rank 0 copied to
``<storage_path>/checkpoint_<n>``. Here they become what Ray Train's ``trainer.fit()`` returns:
``metrics`` (the last report), ``metrics_dataframe`` (every report, nested keys flattened with ``/``
as Ray does), ``checkpoint`` (the latest), ``best_checkpoints`` (kept and deleted by Ray's own
checkpoint manager, following ``ray.train.CheckpointConfig``), ``error``, ``path`` and ``return_value``
(rank 0's return value). ``ray.train`` is imported only when a checkpoint arrives or the result is read.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Optional

from hvdray.storage import next_checkpoint_index, resolve

if TYPE_CHECKING:
    from ray.train import CheckpointConfig, Result


class RunResults:
    """Collects one run's reports (``add``) and turns them into a ``ray.train.Result`` (``result``)."""

    def __init__(self, storage_path: Optional[str], checkpoint_config: Optional["CheckpointConfig"]) -> None:
        self._storage = resolve(storage_path) if storage_path is not None else None
        self._checkpoint_config = checkpoint_config
        self._reports: list[dict[str, Any]] = []
        self._manager: Any = None  # Ray's checkpoint manager, made with the first checkpoint
        self._end: tuple[Optional[BaseException], Any] = (None, None)
        self._result: Optional["Result"] = None

    def first_checkpoint(self) -> int:
        """The number of this run's first checkpoint: one past those already in storage_path (created here)."""
        assert self._storage is not None, "checkpoints need a storage_path"
        fs, base = self._storage
        fs.create_dir(base, recursive=True)
        return next_checkpoint_index(fs, base)

    def add(self, metrics: dict[str, Any], checkpoint_path: Optional[str]) -> None:
        """One report of rank 0, with the path of its persisted checkpoint (or None)."""
        self._reports.append(metrics)
        if checkpoint_path is None:
            return
        from ray.train import Checkpoint
        from ray.train._internal.checkpoint_manager import _CheckpointManager
        from ray.train._internal.session import _TrainingResult

        assert self._storage is not None, "workers persist checkpoints only with a storage_path"
        if self._manager is None:
            self._manager = _CheckpointManager(self._checkpoint_config)
        checkpoint = Checkpoint(checkpoint_path, filesystem=self._storage[0])
        self._manager.register_checkpoint(_TrainingResult(checkpoint=checkpoint, metrics=dict(metrics)))

    def finish(self, error: Optional[BaseException] = None, return_value: Any = None) -> None:
        """The run ended: ``error`` is the exception ``run`` raised, ``return_value`` rank 0's value."""
        self._end = (error, return_value)
        self._result = None

    def result(self) -> "Result":
        """The run's ``ray.train.Result`` (built once, on first use)."""
        if self._result is None:
            self._result = self._build()
        return self._result

    def _build(self) -> "Result":
        import pandas as pd
        from ray.train import Result

        error, return_value = self._end
        latest = self._manager.latest_checkpoint_result if self._manager is not None else None
        best = self._manager.best_checkpoint_results if self._manager is not None else []
        fields: dict[str, Any] = dict(
            metrics=dict(self._reports[-1]) if self._reports else None,
            checkpoint=latest.checkpoint if latest is not None else None,
            error=error,
            path=self._storage[1] if self._storage is not None else None,
            metrics_dataframe=pd.json_normalize(self._reports, sep="/"),
            best_checkpoints=[(r.checkpoint, dict(r.metrics)) for r in best],
            _storage_filesystem=self._storage[0] if self._storage is not None else None,
            return_value=return_value,
        )
        known = {f.name for f in dataclasses.fields(Result)}  # return_value is new in Ray Train v2
        return Result(**{name: value for name, value in fields.items() if name in known})
