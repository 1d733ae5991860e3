"""Job facts every frontend shares: ``init``, rank and size, and what this build can do."""

from __future__ import annotations

from typing import Any

from hvdray.collective import context


def init(*args: Any, **kwargs: Any) -> None:
    """Join the job this worker belongs to (or start a size-1 job outside an executor).

    Horovod's optional arguments (``comm``, ``process_sets``) are not needed on Ray and must be left out.
    """
    if args or kwargs:
        raise ValueError(f"hvd.init() takes no arguments in hvdray, got {args or ''}{kwargs or ''}")
    context.init()


shutdown = context.shutdown
is_initialized = context.is_initialized


def rank() -> int:
    return context.rank_info("hvd.rank()").rank


def size() -> int:
    return context.rank_info("hvd.size()").size


def local_rank() -> int:
    return context.rank_info("hvd.local_rank()").local_rank


def local_size() -> int:
    return context.rank_info("hvd.local_size()").local_size


def cross_rank() -> int:
    return context.rank_info("hvd.cross_rank()").cross_rank


def cross_size() -> int:
    return context.rank_info("hvd.cross_size()").cross_size


def is_homogeneous() -> bool:
    """True when every node runs the same number of workers."""
    info = context.rank_info("hvd.is_homogeneous()")
    return info.local_size * info.cross_size == info.size


def gloo_enabled() -> bool:
    return True


def gloo_built() -> bool:
    return True


def mpi_enabled() -> bool:
    return False


def mpi_built() -> bool:
    return False


def mpi_threads_supported() -> bool:
    return False


def nccl_built() -> bool:
    return False
