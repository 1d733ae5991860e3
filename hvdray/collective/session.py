"""A worker process's collective state, held by one :class:`Session`: what ``hvd.init()`` joins and starts.

A worker actor calls :func:`configure` with its rank and rendezvous before the user's function runs;
``hvd.init()`` then builds the Gloo group and the engine. Without a configured job, ``init`` starts a
working size-1 job on an in-memory store, so the same script runs on a laptop.

In an elastic job the rank comes from a :class:`Membership` instead: ``init`` waits for the epoch that
includes this worker, and :func:`reset` tears the engine and its Gloo group down, leaves the epoch and
joins the next one.

The module-level functions act on the process's one session (``_session``); the engine and
initialized queries read its fields directly, as they run for every op.
"""

from __future__ import annotations

import atexit
import logging
import math
import threading
import time
from typing import TYPE_CHECKING, Optional, Protocol, Union

from hvdray.collective.autotune import Autotuner, TunedParams
from hvdray.collective.engine import Engine
from hvdray.collective.errors import HorovodInternalError, HvdrayError, NetworkDeviceError, NotInitializedError
from hvdray.collective.job import JobConfig, JobSettings, Membership, single_process_job  # noqa: F401 - also read as session.*
from hvdray.collective.timeline import Timeline
from hvdray.collective.topology import RankInfo, engine_threads_have_cores
from hvdray.collective.transport import Communicator, TransportOptions, shm
from hvdray.testing import faults

if TYPE_CHECKING:
    from hvdray.settings import Settings

log = logging.getLogger(__name__)


class RegisteredSet(Protocol):
    """What the registry needs of a process set: the id it was given (None once forgotten)."""

    process_set_id: Optional[int]


class ProcessSetRegistry:
    """The process sets registered in the running job, by id; ids count from 1 alike on every rank."""

    FIRST_ID = 1  # 0 is the global set's

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sets: dict[int, RegisteredSet] = {}
        self.next_id = self.FIRST_ID

    def forget_all(self) -> None:
        """After a shutdown: no set is registered any more (sets must be added again, from id 1)."""
        with self.lock:
            for ps in self.sets.values():
                ps.process_set_id = None
            self.sets.clear()
            self.next_id = self.FIRST_ID


class Session:
    """Everything one worker process holds for collectives: its job, the global engine and one engine per
    process set it belongs to, the init generation, the timeline and the process-set registry."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.job: Optional[JobConfig] = None  # None: the size-1 job of a plain process
        self.single_job: Optional[JobConfig] = None  # that size-1 job, made on first use
        self.engine: Optional[Engine] = None  # the global process set's engine (id 0)
        self.set_engines: dict[int, Engine] = {}  # process set id -> this rank's engine for it (member sets only)
        self.generation = 0
        self.generation_epoch = -1
        self.timeline: Optional[Timeline] = None
        self.process_sets = ProcessSetRegistry()
        self.call = 0  # the executor call whose function this worker runs now (0: none)

    # -- the job --------------------------------------------------------------------------------
    def current_job(self) -> JobConfig:
        """The configured job, or this process's size-1 job."""
        if self.job is not None:
            return self.job
        if self.single_job is None:
            self.single_job = single_process_job()
        return self.single_job

    def configure(self, job: Optional[JobConfig]) -> None:
        """Set (or clear) the job this process belongs to; a running engine of another job is stopped."""
        with self.lock:
            if self.engine is not None and job is not self.job:
                self.shutdown()
            self.job = job

    # -- lifecycle ------------------------------------------------------------------------------
    def init(self) -> None:
        """Join the configured job (or start a size-1 one). Calling it again is a no-op until ``shutdown``.

        In an elastic job a ring that cannot connect (a member of the epoch died, or the driver abandoned
        the epoch) is not an error: the worker leaves that epoch and waits for the next one, within the
        membership's wait limit, until no epoch has connected for ``elastic_timeout`` (then the ring is
        not coming back: say a firewall between the nodes; that raises). A fault of this worker's own
        (:class:`NetworkDeviceError`: its ``nics`` interface is missing) raises at once: every epoch would
        fail the same way.

        That holds for an engine that has stopped too (a peer shut down or the ring broke): its ops keep
        raising what stopped it. Re-joining takes ``shutdown()`` then ``init()`` on every rank (what an
        elastic reset does), so that all ranks count the same generations: a rank that quietly started a
        new engine here would meet its peers' next generation, not the one they are shutting down."""
        with self.lock:
            if self.engine is not None:
                return
            job = self.current_job()
            failing_since: Optional[float] = None
            while True:
                if job.rank_info is None:
                    if job.membership is None:
                        raise HorovodInternalError("this worker has no rank and no membership to ask for one")
                    job.epoch, job.rank_info = job.membership.next_epoch(job.epoch)
                # inits within one epoch get fresh keys; every rank counts from 1 in each epoch, new workers too
                self.generation = self.generation + 1 if self.generation_epoch == job.epoch else 1
                self.generation_epoch = job.epoch
                info = job.rank_info
                try:
                    self.engine = self._start_engine(
                        self._store_prefix(), info.rank, info.size, self._make_tuner(info.rank), placement=info
                    )
                    break
                except HorovodInternalError as exc:
                    if job.membership is None:
                        raise
                    now = time.monotonic()
                    failing_since = now if failing_since is None else failing_since
                    limit = job.settings.elastic_timeout
                    if now - failing_since > limit:
                        raise HvdrayError(
                            f"no membership epoch could connect for elastic_timeout={limit:g} s, the last one "
                            f"{job.epoch}: {exc}"
                        ) from exc
                    # elastic: a member of this epoch is gone; the driver forms the next one with the rest
                    log.warning("hvdray elastic: membership epoch %d could not connect (%s); waiting for the next",
                                job.epoch, exc)
                    job.rank_info = None
            faults.reached("init")
            log.debug("hvdray initialized: rank %d of %d", info.rank, info.size)
            settings = job.settings
            if settings.timeline_filename and self.timeline is None:
                self.start_timeline(settings.timeline_filename, settings.timeline_mark_cycles)

    def shutdown(self) -> None:
        """Stop the engines, drop the Gloo groups and forget the process sets; ``init`` may follow."""
        with self.lock:
            engines = list(self.set_engines.values())
            self.set_engines.clear()
            engine, self.engine = self.engine, None
        for stopped in engines:
            stopped.shutdown()
        if engine is not None:
            engine.shutdown()
        self.stop_timeline()
        self.process_sets.forget_all()

    def reset(self) -> None:
        """Elastic reset: tear down the engine and Gloo group, leave this epoch, join the next one."""
        self.shutdown()
        with self.lock:
            job = self.current_job()
            if job.membership is None:
                raise HvdrayError(
                    "the ring broke and this job is not elastic: only a RayExecutor with min_workers/max_workers "
                    "can re-form it"
                )
            job.rank_info = None
        self.init()

    # -- executor calls ---------------------------------------------------------------------------
    def begin_call(self, call: int) -> None:
        """The worker starts the function of executor call ``call`` (numbered by the driver, the same on
        every rank); engines started during it learn it too."""
        with self.lock:
            self.call = call
            running = self.engines()
        for started in running:
            started.begin_call(call)

    def end_call(self, how: str, timeout_s: float) -> None:
        """The function of the current call has ``how`` ("returned" or "raised"): tell every rank, so that
        ops of this call they wait for and this rank never submitted fail at once naming it. Waits (at
        most ``timeout_s``) until the news has gone out, so that it reaches the peers before the driver
        starts its next call."""
        handles = [h for h in (e.finish_call(how) for e in self.engines()) if h is not None]
        deadline = time.monotonic() + timeout_s
        for handle in handles:
            try:
                handle.wait(max(0.0, deadline - time.monotonic()))
            except Exception as exc:  # noqa: BLE001 - the engine stopped meanwhile: nobody is left to tell
                log.debug("hvdray: could not announce the end of call %d: %s", self.call, exc)

    # -- engines --------------------------------------------------------------------------------
    def _store_prefix(self) -> str:
        """Rendezvous keys of this init: the membership epoch, then a generation counted within it."""
        return f"e{self.current_job().epoch}/gen{self.generation}/"

    def _steps_on_waiting_thread(self, setting: Optional[bool], size: int) -> bool:
        """``steps_on_waiting_thread`` for a group of ``size`` ranks, its "auto" (None): on for a group of one
        (its collectives are the identity: nothing for the engine thread to overlap), else decided by the
        job's ranks on this node (all of them, whatever process set: they share the cores)."""
        if setting is not None:
            return setting
        placement = self.current_job().rank_info
        return size == 1 or not engine_threads_have_cores(placement.local_size if placement is not None else 1)

    def _start_engine(
        self, store_prefix: str, rank: int, size: int, tuner: Optional[Autotuner] = None,
        placement: Optional[RankInfo] = None,
    ) -> Engine:
        """A group of ``size`` ranks on the job's store under ``store_prefix``, and its engine.

        With ``placement`` (the job's own rank info; the global set) ranks on one node may share memory;
        without it (process sets) the group is plain Gloo."""
        job = self.current_job()
        settings = job.settings
        transport = TransportOptions(
            shm=settings.shm_transport,
            hierarchical=settings.hierarchical_allreduce,
            buffer_bytes=int(settings.shm_buffer_mb * (1 << 20)),
            job_tag=shm.job_tag(job.secret),
            adopt_tensors=settings.share_reduced_tensors,
            share_pages=settings.share_reduced_pages,
            cross_memory=settings.cross_memory_attach,
        )
        try:
            comm = Communicator(
                job.store_factory(store_prefix),
                rank,
                size,
                timeout_s=settings.timeout_s,
                hostname=job.host_ip,
                interface=settings.nics[0] if settings.nics else None,
                rank_info=placement,
                transport=transport,
                peer_sockets=settings.peer_sockets,
            )
        except NetworkDeviceError:
            raise  # this worker's own fault, before it met any peer
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
            stall_warning_s=settings.stall_warning_s if settings.stall_check else math.inf,
            stall_shutdown_s=settings.stall_shutdown_s if settings.stall_check else 0.0,
            cache_capacity=settings.cache_capacity,
            tuner=tuner,
            call=self.call,
            output_pool_bytes=int(settings.output_pool_mb * 1024 * 1024),
            steps_on_waiting_thread=self._steps_on_waiting_thread(settings.steps_on_waiting_thread, size),
        )
        started.timeline = self.timeline
        return started

    def _make_tuner(self, rank: int) -> Optional[Autotuner]:
        """Rank 0's autotuner for the global engine when ``autotune`` is on (process sets are not tuned)."""
        settings = self.current_job().settings
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

    def start_set_engine(self, set_id: int, set_rank: int, set_size: int) -> Engine:
        """Start this rank's engine for process set ``set_id`` (its own Gloo group under its own store prefix)."""
        with self.lock:
            self.rank_info(f"process set {set_id}")  # the job must be initialized
            started = self._start_engine(f"{self._store_prefix()}ps{set_id}/", set_rank, set_size)
            self.set_engines[set_id] = started
            started.timeline_pid = set_id
            return started

    def stop_set_engine(self, set_id: int) -> None:
        """Stop this rank's engine for process set ``set_id``, if it has one."""
        with self.lock:
            stopped = self.set_engines.pop(set_id, None)
        if stopped is not None:
            stopped.shutdown()

    def rank_info(self, what: str) -> RankInfo:
        """This worker's ranks in the running job, or NotInitializedError naming ``what``."""
        if self.engine is None:
            raise NotInitializedError(what)
        return self.current_job().rank_info

    def engines(self) -> list[Engine]:
        """Every engine this rank runs: the global one first, then one per process set it belongs to."""
        with self.lock:
            return ([self.engine] if self.engine is not None else []) + list(self.set_engines.values())

    # -- timeline -------------------------------------------------------------------------------
    def start_timeline(self, filename: str, mark_cycles: bool = False) -> None:
        """Record a Chrome-trace timeline of every engine of this rank into ``filename``.

        Rank 0 writes ``filename``; if the name contains ``{rank}``, every rank writes its own file
        (``filename.format(rank=...)``). Other ranks do nothing. A running timeline is closed first.
        """
        if not isinstance(filename, str) or not filename:
            raise ValueError(f"filename must be a non-empty path, got {filename!r}")
        if not isinstance(mark_cycles, bool):
            raise TypeError(f"mark_cycles must be a bool, got {type(mark_cycles).__name__}")
        rank = self.rank_info("hvd.start_timeline()").rank
        self.stop_timeline()
        if "{rank}" not in filename and rank != 0:
            return
        with self.lock:
            self.timeline = Timeline(filename.format(rank=rank) if "{rank}" in filename else filename, mark_cycles)
            for running in self.engines():
                running.timeline = self.timeline

    def stop_timeline(self) -> None:
        """Stop recording and close the timeline file (a no-op when none is recording)."""
        with self.lock:
            timeline, self.timeline = self.timeline, None
            for running in self.engines():
                running.timeline = None
        if timeline is not None:
            timeline.close()


_session = Session()  # this process's one session


def current() -> Session:
    """This process's session (all of its collective state)."""
    return _session


# -- the module-level API the rest of hvdray calls -----------------------------------------------
def configure(job: Optional[JobConfig]) -> None:
    """Set (or clear) the job this process belongs to; a running engine of another job is stopped."""
    _session.configure(job)


def init() -> None:
    """Join the configured job (or start a size-1 one); see :meth:`Session.init`."""
    _session.init()


def begin_call(call: int) -> None:
    """The worker starts the function of executor call ``call``; see :meth:`Session.begin_call`."""
    _session.begin_call(call)


def end_call(how: str) -> None:
    """The function of the current call returned or raised; see :meth:`Session.end_call`."""
    _session.end_call(how, _session.current_job().settings.timeout_s)


def shutdown() -> None:
    """Stop the engines and drop the Gloo groups; ``init`` may be called again afterwards."""
    _session.shutdown()


atexit.register(shutdown)


def reset() -> None:
    """Elastic reset: tear down the engine and Gloo group, leave this epoch, join the next one."""
    _session.reset()


def start_set_engine(set_id: int, set_rank: int, set_size: int) -> Engine:
    """Start this rank's engine for process set ``set_id`` (its own Gloo group under its own store prefix)."""
    return _session.start_set_engine(set_id, set_rank, set_size)


def stop_set_engine(set_id: int) -> None:
    """Stop this rank's engine for process set ``set_id``, if it has one."""
    _session.stop_set_engine(set_id)


def host_updates() -> int:
    """Host updates announced since this worker's elastic epoch was formed; 0 outside elastic jobs."""
    membership = _session.current_job().membership
    return membership.host_updates() if membership is not None else 0


def start_timeline(filename: str, mark_cycles: bool = False) -> None:
    """Record a Chrome-trace timeline of every engine of this rank; see :meth:`Session.start_timeline`."""
    _session.start_timeline(filename, mark_cycles)


def stop_timeline() -> None:
    """Stop recording and close the timeline file (a no-op when none is recording)."""
    _session.stop_timeline()


def is_initialized() -> bool:
    """True from ``init()`` until ``shutdown()``, as Horovod's: also once the engine has stopped (a peer shut down,
    the ring broke), when its ops raise what stopped it and ``init()`` is a no-op until ``shutdown()``. Scripts
    shut down what ``is_initialized()`` reports (Horovod's own tests do): a stopped engine reported as not
    initialized was never shut down, and the rank's next ``init()`` then missed the generation its peers joined."""
    return _session.engine is not None


def engine(what: str = "this operation", set_id: int = 0) -> Engine:
    """The running engine (of process set ``set_id``), or a clear error telling the user to call ``hvd.init()``."""
    session = _session
    current_engine = session.engine if set_id == 0 else session.set_engines.get(set_id)
    if current_engine is None:
        if session.engine is None:
            raise NotInitializedError(what)
        raise ValueError(f"process_set {set_id} has no engine on this rank; {what} cannot run on it")
    return current_engine


def engines() -> list[Engine]:
    """Every engine this rank runs: the global one first, then one per process set it belongs to."""
    return _session.engines()


def rank_info(what: str = "this call") -> RankInfo:
    """This worker's ranks in the running job, or NotInitializedError naming ``what``."""
    return _session.rank_info(what)


def job_secret() -> bytes:
    """The job's shared secret (authenticates pickled objects exchanged between ranks)."""
    return _session.current_job().secret


def settings() -> Union["Settings", JobSettings]:
    """The job's settings (read-only in a worker of an executor)."""
    return _session.current_job().settings
