"""``import hvdray.tensorflow as hvd``: horovod.tensorflow's API on hvdray's engine (TensorFlow 2.16+).

Ops take eager tensors or run inside ``tf.function`` (Keras' compiled train step included); tensors
reach the same engine as ``hvdray.torch``'s through DLPack, sharing their memory on the CPU.
"""

from hvdray.collective.compression import Compression
from hvdray.collective.errors import HorovodInternalError, NotInitializedError, TensorMismatchError
from hvdray.tensorflow import elastic
from hvdray.tensorflow.functions import broadcast_variables
from hvdray.tensorflow.gradients import DistributedGradientTape
from hvdray.tensorflow.ops import (
    Adasum,
    Average,
    Max,
    Min,
    ProcessSet,
    Product,
    ReduceOp,
    Sum,
    add_process_set,
    allgather,
    allgather_object,
    allreduce,
    alltoall,
    barrier,
    broadcast,
    broadcast_object,
    cross_rank,
    cross_size,
    gloo_built,
    gloo_enabled,
    global_process_set,
    grouped_allreduce,
    init,
    is_homogeneous,
    is_initialized,
    join,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    reducescatter,
    remove_process_set,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)

__all__ = [name for name in dir() if not name.startswith("_")]
