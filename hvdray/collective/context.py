"""Process-global job state: what ``hvd.init()`` joins, and the engine it starts.

A worker actor calls :func:`configure` with its rank and rendezvous before the user's function runs;
``hvd.init()`` then builds the Gloo group and the engine. Without a configured job, ``init`` starts a
working size-1 job on an in-memory store, so the same script runs on a laptop.
"""

from __future__ import annotations

import atexit
import logging
import secrets as _secrets
import threading
from dataclasses import dataclass
from typing import Callable, Optional

import torch.distributed as dist

from hvdray.collective import shm
from hvdray.collective.communicator import Communicator
from hvdray.collective.engine import Engine
from hvdray.collective.errors import NotInitializedError
from hvdray.collective.topology import RankInfo
from hvdray.collective.transport import TransportOptions
from hvdray.settings import Settings, make_settings

log = logging.getLogger(__name__)


@dataclass
class JobConfig:
    """What a worker knows about its job; built inside the worker, never sent over the wire."""

    rank_info: RankInfo
    settings: Settings
    secret: bytes
    store_factory: Callable[[str], dist.Store]  # key prefix -> the job's private store
    host_ip: str


_lock = threading.RLock()
_job: Optional[JobConfig] = None
_engine: Optional[Engine] = None
_generation = 0


def configure(job: Optional[JobConfig]) -> None:
    """Set (or clear) the job this process belongs to; a running engine of another job is stopped."""
    global _job
    with _lock:
        if _engine is not None and job is not _job:
            shutdown()
        _job = job


def init() -> None:
    """Join the configured job (or start a size-1 one). Calling it again while running is a no-op."""
    global _engine, _generation
    with _lock:
        if _engine is not None and _engine.alive:
            return
        job = _current_job()
        settings = job.settings
        _generation += 1
        info = job.rank_info
        store = job.store_factory(f"gen{_generation}/")
        comm = Communicator(
            store,
            info.rank,
            info.size,
            timeout_s=settings.timeout_s,
            hostname=job.host_ip,
            interface=settings.nics[0] if settings.nics else None,
            rank_info=info,
            transport=TransportOptions(
                shm=settings.shm_transport,
                hierarchical=settings.hierarchical_allreduce,
                buffer_bytes=int(settings.shm_buffer_mb * (1 << 20)),
                job_tag=shm.job_tag(job.secret),
            ),
        )
        _engine = Engine(
            comm,
            cycle_time_s=settings.cycle_time_ms / 1000.0,
            idle_cycle_time_s=settings.idle_cycle_time_ms / 1000.0,
            fusion_threshold_bytes=int(settings.fusion_threshold_mb * 1024 * 1024),
            stall_warning_s=settings.stall_warning_s,
            stall_shutdown_s=settings.stall_shutdown_s,
            cache_capacity=settings.cache_capacity,
        )
        log.debug("hvdray initialized: rank %d of %d", info.rank, info.size)


def shutdown() -> None:
    """Stop the engine and drop the Gloo group; ``init`` may be called again afterwards."""
    global _engine
    with _lock:
        engine, _engine = _engine, None
    if engine is not None:
        engine.shutdown()


atexit.register(shutdown)


def is_initialized() -> bool:
    return _engine is not None and _engine.alive


def engine(what: str = "this operation") -> Engine:
    """The running engine, or a clear error telling the user to call ``hvd.init()``."""
    current = _engine
    if current is None:
        raise NotInitializedError(what)
    return current


def rank_info(what: str = "this call") -> RankInfo:
    if _engine is None:
        raise NotInitializedError(what)
    return _current_job().rank_info


def job_secret() -> bytes:
    """The job's shared secret (authenticates pickled objects exchanged between ranks)."""
    return _current_job().secret


def settings() -> Settings:
    return _current_job().settings


def _current_job() -> JobConfig:
    return _job or _single_process_job()


_single: Optional[JobConfig] = None


def _single_process_job() -> JobConfig:
    global _single
    if _single is None:
        store = dist.HashStore()
        _single = JobConfig(
            rank_info=RankInfo(rank=0, size=1, local_rank=0, local_size=1, cross_rank=0, cross_size=1),
            settings=make_settings(),
            secret=_secrets.token_bytes(32),
            store_factory=lambda prefix: dist.PrefixStore(prefix, store),
            host_ip="127.0.0.1",
        )
    return _single
