"""``import hvdray.torch as hvd``: horovod.torch's API on hvdray's engine."""

from hvdray.collective.compression import Compression
from hvdray.collective.errors import HorovodInternalError, NotInitializedError, TensorMismatchError
from hvdray.torch.functions import broadcast_optimizer_state, broadcast_parameters
from hvdray.torch.ops import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    ReduceOp,
    Sum,
    allgather,
    allgather_async,
    allgather_object,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    broadcast_object,
    cross_rank,
    cross_size,
    gloo_built,
    gloo_enabled,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
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
    poll,
    rank,
    reducescatter,
    reducescatter_async,
    shutdown,
    size,
    synchronize,
)
from hvdray.torch.optimizer import DistributedOptimizer
from hvdray.torch.sync_batch_norm import SyncBatchNorm

__all__ = [name for name in dir() if not name.startswith("_")]
