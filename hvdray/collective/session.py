"""Process-global job state: what ``hvd.init()`` joins, and the engine it starts.

A worker actor calls :func:`configure` with its rank and rendezvous before the user's function runs;
``hvd.init()`` then builds the Gloo group and the engine. Without a configured job, ``init`` starts a
working size-1 job on an in-memory store, so the same script runs on a laptop.

In an elastic job the rank comes from a :class:`Membership` instead: ``init`` waits for the epoch that
includes this worker, and :func:`reset` tears the engine and its Gloo group down, leaves the epoch and
joins the next one.
"""

from __future__ import annotations

import atexit
import logging
import secrets as _secrets
import threading
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import torch.distributed as dist

from hvdray.collective.autotune import Autotuner, TunedParams
from hvdray.collective.engine import Engine
from hvdray.collective.errors import HorovodInternalError, HvdrayError, NotInitializedError
from hvdray.collective.timeline import Timeline
from hvdray.collective.topology import RankInfo
from hvdray.collective.transport import Communicator, TransportOptions, shm
from hvdray.settings import Settings, make_settings

log = logging.getLogger(__name__)


class Membership(Protocol):
    """Where an elastic worker learns its place in each membership epoch (the worker actor provides it)."""

    def next_epoch(self, left_epoch: int) -> tuple[int, RankInfo]:
        """Block until an epoch newer than ``left_epoch`` includes this worker; its number and our ranks."""

    def host_updates(self) -> int:
        """Host updates the driver announced since this worker's epoch was formed."""


@dataclass
class JobConfig:
    """What a worker knows about its job; built inside the worker, never sent over the wire."""

    rank_info: Optional[RankInfo]  # None: an elastic worker between epochs
    settings: Settings
    secret: bytes
    store_factory: Callable[[str], dist.Store]  # key prefix -> the job's private store
    host_ip: str
    epoch: int = 1
    membership: Optional[Membership] = None


_lock = threading.RLock()
_job: Optional[JobConfig] = None
_engine: Optional[Engine] = None  # the global process set's engine (id 0)
_set_engines: dict[int, Engine] = {}  # process set id -> this rank's engine for it (member sets only)
_generation = 0
_generation_epoch = -1


def configure(job: Optional[JobConfig]) -> None:
    """Set (or clear) the job this process belongs to; a running engine of another job is stopped."""
    global _job
    with _lock:
        if _engine is not None and job is not _job:
            shutdown()
        _job = job


def _store_prefix() -> str:
    """Rendezvous keys of this init: the membership epoch, then a generation counted within it."""
    return f"e{_current_job().epoch}/gen{_generation}/"


def _start_engine(
    store_prefix: str, rank: int, size: int, tuner: Optional[Autotuner] = None, placement: Optional[RankInfo] = None
) -> Engine:
    """A group of ``size`` ranks on the job's store under ``store_prefix``, and its engine.

    With ``placement`` (the job's own rank info; the global set) ranks on one node may share memory;
    without it (process sets) the group is plain Gloo."""
    job = _current_job()
    settings = job.settings
    try:
        comm = Communicator(
            job.store_factory(store_prefix),
            rank,
            size,
            timeout_s=settings.timeout_s,
            hostname=job.host_ip,
            interface=settings.nics[0] if settings.nics else None,
            rank_info=placement,
            transport=TransportOptions(
                shm=settings.shm_transport,
                hierarchical=settings.hierarchical_allreduce,
                buffer_bytes=int(settings.shm_buffer_mb * (1 << 20)),
                job_tag=shm.job_tag(job.secret),
            ),
        )
    except Exception as exc:  # noqa: BLE001 - a peer that vanished during the rendezvous
        raise HorovodInternalError(
            f"rank {rank} could not connect to its {size - 1} peer(s) under {store_prefix!r} "
            f"(membership epoch {job.epoch}): {exc}"
        ) from exc
    started = Engine(
        comm,
        cycle_time_s=settings.cycle_time_ms / 1000.0,
        idle_cycle_time_s=settings.idle_cycle_time_ms / 1000.0,
        fusion_threshold_bytes=int(settings.fusion_threshold_mb * 1024 * 1024),
        stall_warning_s=settings.stall_warning_s,
        stall_shutdown_s=settings.stall_shutdown_s,
        cache_capacity=settings.cache_capacity,
        tuner=tuner,
    )
    started.timeline = _timeline
    return started


def init() -> None:
    """Join the configured job (or start a size-1 one). Calling it again is a no-op until ``shutdown``.

    That holds for an engine that has stopped too (a peer shut down or the ring broke): its ops keep
    raising what stopped it. Re-joining takes ``shutdown()`` then ``init()`` on every rank (what an
    elastic reset does), so that all ranks count the same generations: a rank that quietly started a
    new engine here would meet its peers' next generation, not the one they are shutting down."""
    global _engine, _generation, _generation_epoch
    with _lock:
        if _engine is not None:
            return
        job = _current_job()
        if job.rank_info is None:
            if job.membership is None:
                raise HorovodInternalError("this worker has no rank and no membership to ask for one")
            job.epoch, job.rank_info = job.membership.next_epoch(job.epoch)
        # inits within one epoch get fresh keys; every rank counts from 1 in each epoch, new workers too
        _generation = _generation + 1 if _generation_epoch == job.epoch else 1
        _generation_epoch = job.epoch
        info = job.rank_info
        _engine = _start_engine(_store_prefix(), info.rank, info.size, _make_tuner(info.rank), placement=info)
        log.debug("hvdray initialized: rank %d of %d", info.rank, info.size)
        settings = _current_job().settings
        if settings.timeline_filename and _timeline is None:
            start_timeline(settings.timeline_filename, settings.timeline_mark_cycles)


def _make_tuner(rank: int) -> Optional[Autotuner]:
    """Rank 0's autotuner for the global engine when ``autotune`` is on (process sets are not tuned)."""
    settings = _current_job().settings
    if not settings.autotune or rank != 0:
        return None
    return Autotuner(
        TunedParams(settings.fusion_threshold_mb, settings.cycle_time_ms, settings.cache_capacity > 0),
        warmup_samples=settings.autotune_warmup_samples,
        steps_per_sample=settings.autotune_steps_per_sample,
        max_samples=settings.autotune_bayes_opt_max_samples,
        gaussian_process_noise=settings.autotune_gaussian_process_noise,
        log_file=settings.autotune_log_file,
        tune_cache=settings.cache_capacity > 0,
    )


def start_set_engine(set_id: int, set_rank: int, set_size: int) -> Engine:
    """Start this rank's engine for process set ``set_id`` (its own Gloo group under its own store prefix)."""
    with _lock:
        engine(f"process set {set_id}")  # the job must be initialized
        started = _set_engines[set_id] = _start_engine(f"{_store_prefix()}ps{set_id}/", set_rank, set_size)
        started.timeline_pid = set_id
        return started


def stop_set_engine(set_id: int) -> None:
    """Stop this rank's engine for process set ``set_id``, if it has one."""
    with _lock:
        stopped = _set_engines.pop(set_id, None)
    if stopped is not None:
        stopped.shutdown()


def shutdown() -> None:
    """Stop the engines and drop the Gloo groups; ``init`` may be called again afterwards."""
    global _engine
    with _lock:
        engines = list(_set_engines.values())
        _set_engines.clear()
        engine, _engine = _engine, None
    for stopped in engines:
        stopped.shutdown()
    if engine is not None:
        engine.shutdown()
    stop_timeline()
    for hook in _shutdown_hooks:
        hook()


_shutdown_hooks: list[Callable[[], None]] = []


def on_shutdown(hook: Callable[[], None]) -> None:
    """Call ``hook`` after every shutdown (modules that keep per-job state forget it there)."""
    _shutdown_hooks.append(hook)


atexit.register(shutdown)


def reset() -> None:
    """Elastic reset: tear down the engine and Gloo group, leave this epoch, join the next one."""
    shutdown()
    with _lock:
        job = _current_job()
        if job.membership is None:
            raise HvdrayError(
                "the ring broke and this job is not elastic: only a RayExecutor with min_workers/max_workers "
                "can re-form it"
            )
        job.rank_info = None
    init()


def host_updates() -> int:
    """Host updates announced since this worker's elastic epoch was formed; 0 outside elastic jobs."""
    membership = _current_job().membership
    return membership.host_updates() if membership is not None else 0


_timeline: Optional[Timeline] = None


def start_timeline(filename: str, mark_cycles: bool = False) -> None:
    """Record a Chrome-trace timeline of every engine of this rank into ``filename``.

    Rank 0 writes ``filename``; if the name contains ``{rank}``, every rank writes its own file
    (``filename.format(rank=...)``). Other ranks do nothing. A running timeline is closed first.
    """
    global _timeline
    if not isinstance(filename, str) or not filename:
        raise ValueError(f"filename must be a non-empty path, got {filename!r}")
    if not isinstance(mark_cycles, bool):
        raise TypeError(f"mark_cycles must be a bool, got {type(mark_cycles).__name__}")
    rank = rank_info("hvd.start_timeline()").rank
    stop_timeline()
    if "{rank}" not in filename and rank != 0:
        return
    with _lock:
        _timeline = Timeline(filename.format(rank=rank) if "{rank}" in filename else filename, mark_cycles)
        for running in engines():
            running.timeline = _timeline


def stop_timeline() -> None:
    """Stop recording and close the timeline file (a no-op when none is recording)."""
    global _timeline
    with _lock:
        timeline, _timeline = _timeline, None
        for running in engines():
            running.timeline = None
    if timeline is not None:
        timeline.close()


def is_initialized() -> bool:
    return _engine is not None and _engine.alive


def engine(what: str = "this operation", set_id: int = 0) -> Engine:
    """The running engine (of process set ``set_id``), or a clear error telling the user to call ``hvd.init()``."""
    current = _engine if set_id == 0 else _set_engines.get(set_id)
    if current is None:
        if _engine is None:
            raise NotInitializedError(what)
        raise ValueError(f"process_set {set_id} has no engine on this rank; {what} cannot run on it")
    return current


def engines() -> list[Engine]:
    """Every engine this rank runs: the global one first, then one per process set it belongs to."""
    with _lock:
        return ([_engine] if _engine is not None else []) + list(_set_engines.values())


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
