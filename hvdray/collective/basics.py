"""Job facts every frontend shares: ``init``, rank and size, process sets, the timeline, and what this
build can do (build.py). ``__all__`` is the list; each frontend re-exports it as it is (``from ... import *``)."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from hvdray.collective import build, session
from hvdray.collective.build import *  # noqa: F401,F403 - Horovod's build queries (gloo_built ...)
from hvdray.collective import process_sets as process_sets_module
from hvdray.collective.process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set

__all__ = [
    "init", "shutdown", "is_initialized",
    "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size", "is_homogeneous",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "start_timeline", "stop_timeline",
    *build.__all__,
]


def init(comm: Any = None, process_sets: Optional[Sequence[Any]] = None) -> None:
    """Join the job this worker belongs to (or start a size-1 job outside an executor).

    ``process_sets``: :class:`ProcessSet` objects (or lists of ranks) to register at once; every rank
    must pass the same list. Horovod's ``comm`` (an MPI communicator) has no meaning on Ray and must be None.
    """
    if comm is not None:
        raise ValueError("comm: hvdray does not use MPI communicators; leave comm out")
    session.init()
    process_sets_module.add_initial_sets(process_sets)


shutdown = session.shutdown
is_initialized = session.is_initialized
start_timeline = session.start_timeline
stop_timeline = session.stop_timeline


def rank() -> int:
    """This worker's rank in the job: 0 .. size() - 1, contiguous per node."""
    return session.rank_info("hvd.rank()").rank


def size() -> int:
    """The number of workers in the job (in an elastic job: in the current membership epoch)."""
    return session.rank_info("hvd.size()").size


def local_rank() -> int:
    """This worker's rank among the workers on its node (Ray node id)."""
    return session.rank_info("hvd.local_rank()").local_rank


def local_size() -> int:
    """The number of workers on this worker's node."""
    return session.rank_info("hvd.local_size()").local_size


def cross_rank() -> int:
    """This worker's node's rank among the nodes (Horovod's cross rank: workers of one local rank)."""
    return session.rank_info("hvd.cross_rank()").cross_rank


def cross_size() -> int:
    """The number of nodes with a worker of this worker's local rank (Horovod's cross size)."""
    return session.rank_info("hvd.cross_size()").cross_size


def is_homogeneous() -> bool:
    """True when every node runs the same number of workers."""
    info = session.rank_info("hvd.is_homogeneous()")
    return info.local_size * info.cross_size == info.size

