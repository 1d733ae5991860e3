"""``import hvdray.torch as hvd``: horovod.torch's API on hvdray's engine."""

from hvdray.collective.basics import *  # noqa: F401,F403 - the job facts every frontend shares (basics.__all__)
from hvdray.collective.compression import Compression
from hvdray.collective.errors import HorovodInternalError, NotInitializedError, PeerFinishedError, TensorMismatchError
from hvdray.torch.ops import *  # noqa: F401,F403 - every op in each of its forms, reduce ops, poll, synchronize
from hvdray.torch.functions import broadcast_optimizer_state, broadcast_parameters
from hvdray.torch import elastic
from hvdray.torch.optimizer import DistributedOptimizer
from hvdray.torch.sync_batch_norm import SyncBatchNorm

__all__ = [name for name in dir() if not name.startswith("_")]
