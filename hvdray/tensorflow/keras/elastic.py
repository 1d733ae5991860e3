"""``hvd.elastic`` for ``hvdray.keras`` / ``hvdray.tensorflow.keras``: ``KerasState`` and the callbacks
that keep it current during ``model.fit``."""

from __future__ import annotations

from typing import Any, Optional

import keras

from hvdray.tensorflow.elastic import (
    HorovodInternalError,
    HostsUpdatedInterrupt,
    ObjectState,
    State,
    TensorFlowKerasState,
    run,
)

__all__ = [
    "CommitStateCallback", "HorovodInternalError", "HostsUpdatedInterrupt", "KerasState", "ObjectState", "State",
    "UpdateBatchStateCallback", "UpdateEpochStateCallback", "run",
]


class KerasState(TensorFlowKerasState):
    """Horovod's ``hvd.elastic.KerasState(model, optimizer=None, **kwargs)`` for Keras."""

    def __init__(self, model: Any, optimizer: Any = None, **kwargs: Any) -> None:
        super().__init__(model, optimizer=optimizer, **kwargs)


class CommitStateCallback(keras.callbacks.Callback):
    """Commit ``state`` every ``batches_per_commit`` batches and at the end of every epoch."""

    def __init__(self, state: State, batches_per_commit: int = 1) -> None:
        super().__init__()
        if isinstance(batches_per_commit, bool) or not isinstance(batches_per_commit, int) or batches_per_commit < 1:
            raise ValueError(f"batches_per_commit must be an int >= 1, got {batches_per_commit!r}")
        self.state = state
        self.batches_per_commit = batches_per_commit
        self._batches = 0

    def on_batch_end(self, batch: int, logs: Optional[dict[str, Any]] = None) -> None:
        self._batches += 1
        if self._batches % self.batches_per_commit == 0:
            self.state.commit()

    def on_epoch_end(self, epoch: int, logs: Optional[dict[str, Any]] = None) -> None:
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keep ``state.batch`` at the next batch to run, and 0 at each epoch's end."""

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state

    def on_batch_end(self, batch: int, logs: Optional[dict[str, Any]] = None) -> None:
        self.state.batch = batch + 1

    def on_epoch_end(self, epoch: int, logs: Optional[dict[str, Any]] = None) -> None:
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keep ``state.epoch`` at the next epoch to run (pass ``initial_epoch=state.epoch`` to ``fit``)."""

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state

    def on_epoch_end(self, epoch: int, logs: Optional[dict[str, Any]] = None) -> None:
        self.state.epoch = epoch + 1
