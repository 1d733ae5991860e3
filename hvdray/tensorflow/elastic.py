"""``hvd.elastic`` for TensorFlow and Keras: the worker-side elastic API plus states for Keras models and
plain TensorFlow variables."""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, Optional, TypeVar

import numpy as np
import tensorflow as tf

from hvdray.elastic import HorovodInternalError, HostsUpdatedInterrupt, ObjectState, State
from hvdray.elastic import run as _run
from hvdray.tensorflow.functions import broadcast_variables

R = TypeVar("R")

__all__ = [
    "HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState", "State", "TensorFlowKerasState",
    "TensorFlowState", "run",
]


def run(func: Callable[..., R]) -> Callable[..., R]:
    """``hvd.elastic.run`` for TensorFlow: a peer failure inside a ``tf.function`` (Keras' train step
    included) reaches Python as ``tf.errors.UnknownError``; it is handled as the HorovodInternalError it is."""

    @functools.wraps(func)
    def translated(state: State, *args: Any, **kwargs: Any) -> R:
        try:
            return func(state, *args, **kwargs)
        except tf.errors.UnknownError as exc:
            if HorovodInternalError.__name__ not in str(exc):
                raise
            raise HorovodInternalError(f"a collective inside a tf.function failed: {exc.message}") from exc

    return _run(translated)


class TensorFlowState(ObjectState):
    """A list of ``tf.Variable``s and any picklable attributes, committed, restored and synced.

    ``session`` is accepted for Horovod compatibility; hvdray supports TensorFlow 2 (eager) only."""

    def __init__(self, variables: Optional[Iterable[Any]] = None, session: Any = None, **kwargs: Any) -> None:
        if session is not None:
            raise ValueError("session is for TensorFlow 1 graphs, which hvdray does not support; leave it out")
        self.variables = list(variables or ())
        self._saved_values: list[np.ndarray] = []
        super().__init__(**kwargs)

    def _tracked(self) -> list[Any]:
        return self.variables

    def save(self) -> None:
        self._saved_values = [np.array(v.numpy(), copy=True) for v in self._tracked()]
        super().save()

    def restore(self) -> None:
        tracked = self._tracked()
        if len(tracked) == len(self._saved_values):
            for var, value in zip(tracked, self._saved_values):
                var.assign(value)
        super().restore()

    def _saved_copy(self) -> dict[str, Any]:
        return {**super()._saved_copy(), "values": self._saved_values}

    def _load_copy(self, saved: dict[str, Any]) -> None:
        self._saved_values = list(saved["values"])
        super()._load_copy(saved)

    def _sync_from(self, root_rank: int) -> None:
        broadcast_variables(self._tracked(), root_rank=root_rank, name="hvdray.elastic.variables")
        super()._sync_from(root_rank)


class TensorFlowKerasState(TensorFlowState):
    """A Keras model's weights, its optimizer's variables and picklable attributes as one elastic state.

    The optimizer defaults to ``model.optimizer``; it is built on every rank before a sync, so that a
    new worker has the same slots to receive as the survivors send. ``backend`` is accepted for
    Horovod compatibility."""

    def __init__(self, model: Any, optimizer: Any = None, backend: Any = None, **kwargs: Any) -> None:
        if not hasattr(model, "variables") or not hasattr(model, "trainable_variables"):
            raise TypeError(f"model must be a Keras model, got {type(model).__name__}")
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        super().__init__(**kwargs)

    def _tracked(self) -> list[Any]:
        tracked = list(self.model.variables)
        if self.optimizer is not None:
            tracked += list(self.optimizer.variables)
        return tracked

    def _sync_from(self, root_rank: int) -> None:
        if self.optimizer is not None and not getattr(self.optimizer, "built", True):
            self.optimizer.build(self.model.trainable_variables)
        super()._sync_from(root_rank)
