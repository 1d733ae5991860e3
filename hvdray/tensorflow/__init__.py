"""``import hvdray.tensorflow as hvd``: horovod.tensorflow's API on hvdray's engine (TensorFlow 2.16+).

Ops take eager tensors or run inside ``tf.function`` (Keras' compiled train step included); tensors
reach the same engine as ``hvdray.torch``'s through DLPack, sharing their memory on the CPU.
"""

from hvdray.collective.basics import *  # noqa: F401,F403 - the job facts every frontend shares (basics.__all__)
from hvdray.collective.errors import HorovodInternalError, NotInitializedError, PeerFinishedError
from hvdray.tensorflow import bridge, elastic
from hvdray.tensorflow.compression import Compression
from hvdray.tensorflow.errors import TensorMismatchError
from hvdray.tensorflow.functions import (
    broadcast_, broadcast_global_variables, broadcast_object_fn, broadcast_variables,
)
from hvdray.tensorflow.gradients import DistributedGradientTape, PartialDistributedGradientTape
from hvdray.tensorflow.job_ops import local_rank_op, local_size_op, process_set_included_op, rank_op, size_op
from hvdray.tensorflow.legacy_optimizer import DistributedOptimizer
from hvdray.tensorflow.sync_batch_norm import SyncBatchNormalization
from hvdray.tensorflow.ops import *  # noqa: F401,F403 - every op in its blocking form, and the reduce ops
from hvdray.tensorflow.util import _executing_eagerly  # noqa: F401 - Horovod's private helper, used by its scripts

__all__ = [name for name in dir() if not name.startswith("_")]
bridge.leave_to_python(globals(), __all__)
