"""Horovod's Keras callbacks for Keras 3: start from root's weights, average metrics, warm up and
schedule the learning rate."""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import keras
import tensorflow as tf

from hvdray.collective import basics
from hvdray.collective import ops as _c
from hvdray.tensorflow import ops as _ops
from hvdray.tensorflow.functions import broadcast_variables
from hvdray.tensorflow.gradients import variable_key


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Overwrite every rank's model weights and optimizer state with root's before the first step.

    The optimizer is built early if needed, so ranks that start from different weights train exactly
    like one process starting from root's. A model that is not built when training begins (no input
    shape) is broadcast after its first batch instead, as Horovod does.
    """

    def __init__(self, root_rank: int, device: str = "", local_variables: Any = None) -> None:
        super().__init__()
        if isinstance(root_rank, bool) or not isinstance(root_rank, int):
            raise TypeError(f"root_rank must be an int, got {type(root_rank).__name__}")
        _ops.check_common(device_dense=device)
        self.root_rank = root_rank
        self.broadcast_done = False
        self._local: dict[Any, Any] = {}
        if local_variables is not None:
            many = isinstance(local_variables, (list, tuple, set))
            for i, var in enumerate(local_variables if many else [local_variables]):
                self._local[variable_key(var, f"local_variables[{i}]" if many else "local_variables")] = var

    def register_local_var(self, var: Any) -> None:
        """Leave ``var`` out of the broadcast: each rank keeps its own value."""
        self._local[variable_key(var)] = var

    def _broadcast(self) -> None:
        model = self.model
        variables = [v for v in model.weights if variable_key(v, None) not in self._local]
        optimizer = model.optimizer
        if optimizer is not None:
            if not optimizer.built:
                optimizer.build(model.trainable_variables)
            variables += list(optimizer.variables)
        broadcast_variables(variables, self.root_rank, name="BroadcastGlobalVariablesCallback")
        self.broadcast_done = True

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        if not self.broadcast_done and self.model.built:
            self._broadcast()

    def on_train_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        if not self.broadcast_done:
            self._broadcast()


class MetricAverageCallback(keras.callbacks.Callback):
    """At the end of each epoch, replace every numeric entry of ``logs`` (``loss``, ``accuracy``,
    ``val_*``, …) by its average over the ranks. Put it before callbacks that read the metrics
    (checkpoints, early stopping); Keras' own History and progress bar already come after it."""

    def __init__(self, device: str = "") -> None:
        super().__init__()
        _ops.check_common(device_dense=device)

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        if not logs:
            return
        keys = sorted(k for k, v in logs.items() if isinstance(v, (int, float)) and not isinstance(v, bool))
        if not keys:
            return
        values = tf.constant([float(logs[k]) for k in keys], dtype=tf.float64)
        averaged = _ops.allreduce(values, op=_c.Average, name="MetricAverageCallback").numpy()
        for key, value in zip(keys, averaged):
            logs[key] = float(value)


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Set the learning rate to ``initial_lr * multiplier(epoch)`` from ``start_epoch`` until ``end_epoch``.

    ``multiplier`` is a function of the epoch or a number (``multiplier ** epoch``). With ``staircase``
    the rate changes at the start of each epoch, otherwise at every batch (fractional epochs).
    ``momentum_correction`` scales the optimizer's momentum buffers by new_lr / old_lr whenever the
    rate changes (Goyal et al., 2017), as Horovod's temporary momentum change does.
    """

    def __init__(
        self,
        initial_lr: float,
        multiplier: Union[float, Callable[[float], float]],
        start_epoch: int = 0,
        end_epoch: Optional[int] = None,
        staircase: bool = True,
        momentum_correction: bool = True,
        steps_per_epoch: Optional[int] = None,
    ) -> None:
        super().__init__()
        if isinstance(initial_lr, bool) or not isinstance(initial_lr, (int, float)) or initial_lr <= 0:
            raise ValueError(f"initial_lr must be a number > 0, got {initial_lr!r}")
        if not callable(multiplier):
            if isinstance(multiplier, bool) or not isinstance(multiplier, (int, float)):
                raise TypeError(f"multiplier must be a number or a function of the epoch, got {multiplier!r}")
            factor = float(multiplier)
            multiplier = lambda epoch: factor**epoch  # noqa: E731
        _check_count("start_epoch", start_epoch, minimum=0)
        if end_epoch is not None:
            _check_count("end_epoch", end_epoch, minimum=start_epoch + 1)
        if steps_per_epoch is not None:
            _check_count("steps_per_epoch", steps_per_epoch, minimum=1)
        self.initial_lr = float(initial_lr)
        self.multiplier = multiplier
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = bool(staircase)
        self.momentum_correction = bool(momentum_correction)
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = 0

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        if not isinstance(self.model.optimizer.learning_rate, keras.Variable):
            raise ValueError(
                f"{type(self).__name__} sets the learning rate, but the optimizer's learning_rate is a schedule or "
                "a function; create the optimizer with a float learning_rate"
            )
        if not self.staircase and self.steps_per_epoch is None:
            self.steps_per_epoch = self.params.get("steps")
            if not self.steps_per_epoch:
                raise ValueError(
                    f"{type(self).__name__} could not tell the number of steps per epoch; pass steps_per_epoch="
                )

    def on_epoch_begin(self, epoch: int, logs: Optional[dict] = None) -> None:
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: Optional[dict] = None) -> None:
        epoch = self.current_epoch
        if epoch < self.start_epoch or (self.end_epoch is not None and epoch >= self.end_epoch):
            return
        if self.staircase:
            if batch == 0:
                self._set_learning_rate(self.initial_lr * self.multiplier(epoch))
        else:
            self._set_learning_rate(self.initial_lr * self.multiplier(epoch + batch / self.steps_per_epoch))

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        if logs is not None:
            logs["lr"] = _learning_rate(self.model.optimizer)

    def _set_learning_rate(self, new_lr: float) -> None:
        optimizer = self.model.optimizer
        old_lr = _learning_rate(optimizer)
        optimizer.learning_rate = new_lr
        if self.momentum_correction and old_lr > 0 and new_lr != old_lr:
            for buffer in _momentum_buffers(optimizer):
                buffer.assign(buffer * (new_lr / old_lr))


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramp the learning rate from ``initial_lr / size()`` up to ``initial_lr`` over ``warmup_epochs``,
    batch by batch (Goyal et al., 2017): large effective batches train stably from the start."""

    def __init__(
        self,
        initial_lr: float,
        warmup_epochs: int = 5,
        momentum_correction: bool = True,
        steps_per_epoch: Optional[int] = None,
        verbose: int = 0,
    ) -> None:
        _check_count("warmup_epochs", warmup_epochs, minimum=1)

        def multiplier(epoch: float) -> float:
            epoch += 1.0 / self.steps_per_epoch  # reach round numbers at the end of each epoch
            return 1.0 / basics.size() * (epoch * (basics.size() - 1) / warmup_epochs + 1)

        super().__init__(
            initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
            momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch,
        )
        self.verbose = verbose

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and basics.rank() == 0:
            lr = _learning_rate(self.model.optimizer)
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {lr:g}.")


def _learning_rate(optimizer: Any) -> float:
    return float(keras.ops.convert_to_numpy(optimizer.learning_rate))


def _momentum_buffers(optimizer: Any) -> list[Any]:
    """The momentum buffers (which include the learning rate) of SGD and RMSprop with momentum > 0."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)  # a LossScaleOptimizer's wrapped optimizer
    if not getattr(inner, "momentum", 0):
        return []
    return [b for b in (getattr(inner, "momentums", None) or getattr(inner, "_momentums", None) or []) if b is not None]


def _check_count(argument: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{argument} must be an int >= {minimum}, got {value!r}")
