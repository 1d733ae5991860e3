"""``import hvdray.tensorflow as hvd``: horovod.tensorflow's API on hvdray's engine (TensorFlow 2.16+).

Ops take eager tensors or run inside ``tf.function`` (Keras' compiled train step included); tensors
reach the same engine as ``hvdray.torch``'s through DLPack, sharing their memory on the CPU.
"""

from hvdray.collective.basics import *  # noqa: F401,F403 - the job facts every frontend shares (basics.__all__)
from hvdray.collective.compression import Compression
from hvdray.collective.errors import HorovodInternalError, NotInitializedError, PeerFinishedError, TensorMismatchError
from hvdray.tensorflow import elastic
from hvdray.tensorflow.functions import broadcast_variables
from hvdray.tensorflow.gradients import DistributedGradientTape
from hvdray.tensorflow.ops import *  # noqa: F401,F403 - every op in its blocking form, and the reduce ops

__all__ = [name for name in dir() if not name.startswith("_")]
