"""``hvd.SyncBatchNormalization``: Keras batch normalization whose training statistics are those of the
union of every rank's batch (equal batch sizes assumed, as Horovod's)."""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from hvdray.collective import basics
from hvdray.collective.ops import Average
from hvdray.tensorflow import ops as _ops


@keras.saving.register_keras_serializable(package="hvdray")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """``keras.layers.BatchNormalization`` with its batch mean and variance averaged across ranks in training
    (one allreduce of [mean, mean of squares] per call, differentiable). Inference uses the moving averages,
    which every rank updates from the same statistics."""

    def __init__(self, fused: Any = False, **kwargs: Any) -> None:
        if fused is not False:
            raise ValueError(f"fused={fused!r}: SyncBatchNormalization does not support fused=True (or None)")
        kwargs.setdefault("name", "sync_batch_normalization")
        super().__init__(**kwargs)

    def _moments(self, inputs: Any, mask: Any) -> tuple[Any, Any]:
        mean, variance = super()._moments(inputs, mask)
        if basics.size() == 1:
            return mean, variance
        local = tf.stack([mean, variance + tf.square(mean)])
        group_mean, group_mean_of_square = tf.unstack(_ops.allreduce(local, op=Average, name=f"{self.name}.moments"))
        return group_mean, group_mean_of_square - tf.square(group_mean)
