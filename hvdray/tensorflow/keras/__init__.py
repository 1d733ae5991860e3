"""``import hvdray.tensorflow.keras as hvd``: horovod.tensorflow.keras for Keras 3 (TensorFlow backend).

``hvd.DistributedOptimizer`` makes ``model.fit`` average gradients across ranks; ``hvd.callbacks``
holds the broadcast, metric-average and learning-rate callbacks; ``hvd.load_model`` reloads a model
saved with a distributed optimizer. The value ops here take Horovod's Keras signatures (``value``
first, ``name`` second).
"""

from typing import Any, Optional

import tensorflow as tf

from hvdray.collective.basics import *  # noqa: F401,F403 - the job facts every frontend shares (basics.__all__)
from hvdray.collective.errors import HorovodInternalError, NotInitializedError
from hvdray.tensorflow import ops as _ops
from hvdray.tensorflow.compression import Compression
from hvdray.tensorflow.errors import TensorMismatchError
from hvdray.tensorflow.functions import broadcast_global_variables, broadcast_variables
from hvdray.tensorflow.keras import callbacks, elastic
from hvdray.tensorflow.keras.optimizer import DistributedOptimizer, PartialDistributedOptimizer, load_model
from hvdray.tensorflow.ops import Adasum, Average, Max, Min, Product, Sum, allgather_object, broadcast_object


def allreduce(
    value: Any,
    name: Optional[str] = None,
    average: Optional[bool] = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    op: Any = None,
    compression: Any = Compression.none,
) -> tf.Tensor:
    """Reduce a tensor-compatible ``value`` across ranks (Average unless ``op``/``average`` say otherwise)."""
    return _ops.allreduce(
        value, average=average, compression=compression, op=op, prescale_factor=prescale_factor,
        postscale_factor=postscale_factor, name=name,
    )


def allgather(value: Any, name: Optional[str] = None) -> tf.Tensor:
    """Concatenate every rank's ``value`` along the first dimension."""
    return _ops.allgather(value, name=name)


def broadcast(value: Any, root_rank: int, name: Optional[str] = None) -> tf.Tensor:
    """Root's ``value`` on every rank."""
    return _ops.broadcast(value, root_rank, name=name)


def reducescatter(value: Any, name: Optional[str] = None, op: Any = Average) -> tf.Tensor:
    """Reduce ``value`` across ranks and keep this rank's slice of the first dimension."""
    return _ops.reducescatter(value, op=op, name=name)


__all__ = [name for name in dir() if not name.startswith("_") and name not in ("Any", "Optional", "tf", "optimizer")]

from hvdray.tensorflow.bridge import leave_to_python as _leave_to_python  # noqa: E402

_leave_to_python(globals(), __all__)
del _leave_to_python
