"""The worker actor: one per rank. Runs the user's functions and holds a stateful executable."""

from __future__ import annotations

import gc
import itertools
import logging
import os
import secrets
import socket
import sys
import threading
from typing import Any, Callable, Optional, Sequence

import ray
from ray._private.ray_constants import LOG_PREFIX_ACTOR_NAME

from hvdray import ray_logger
from hvdray.worker import datasets, reporting
from hvdray.worker.membership import CoordinatorMembership, export_rank_env
from hvdray.collective.job import JobSettings
from hvdray.collective.topology import RankInfo, WorkerSlot


class Worker:
    """Created by the driver's worker group (named there); configured once ranks are known."""

    def __init__(self) -> None:
        self._executable: Any = None
        self._coordinator: Any = None
        self._pending_logs: list[Any] = []
        self._record_sender = f"{socket.gethostname()}/{os.getpid()}/{secrets.token_hex(4)}"
        self._record_numbers = itertools.count()
        self._rank: Optional[int] = None
        self._worker_id: Optional[str] = None

    def __repr__(self) -> str:
        """What Ray shows for this actor: the prefix of its log lines (``(rank 1 pid=...)``), error
        tracebacks and the dashboard. Elastic workers add their id, since their rank changes."""
        if self._worker_id is None:
            return f"rank {self._rank}" if self._rank is not None else "hvdray worker"
        if self._rank is None:
            return f"worker {self._worker_id}"
        return f"rank {self._rank}, worker {self._worker_id}"

    def _took_rank(self, rank: Optional[int]) -> None:
        """Remember the rank and have Ray prefix this process's next log lines with it: Ray reads the
        actor's name from a marker line in its stdout/stderr, which it writes only at creation."""
        self._rank = rank
        for stream in (sys.__stdout__, sys.__stderr__):
            if stream is not None:
                stream.write(f"{LOG_PREFIX_ACTOR_NAME}{self!r}\n")
                stream.flush()

    def slot(self) -> WorkerSlot:
        """Where this worker runs, for rank assignment."""
        return WorkerSlot(
            node_id=ray.get_runtime_context().get_node_id(),
            hostname=socket.gethostname(),
            ip=ray.util.get_node_ip_address(),
            gpu_ids=tuple(str(g) for g in ray.get_gpu_ids()),
        )

    def configure(
        self,
        rank_info: Optional[RankInfo],
        epoch: int,
        settings: JobSettings,
        secret: bytes,
        coordinator: Any,
        node_gpu_ids: Sequence[str],
        worker_id: Optional[str] = None,
        joins_running_job: bool = False,
    ) -> None:
        """Join membership ``epoch`` with ``rank_info``; ``hvd.init()`` inside ``run`` then connects.

        An elastic worker gets ``rank_info=None`` and a ``worker_id``: ``hvd.init()`` then waits for
        the epoch the driver forms with it, and elastic resets move it from epoch to epoch. One that
        ``joins_running_job`` (a resize, a replacement) first loads what the user's function will."""
        if settings.huge_pages:  # read by torch's allocator once, at its first allocation: before torch loads
            os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
        from hvdray.worker.rendezvous import CoordinatorStore  # torch: imported in the worker, not the driver
        from hvdray.collective import session

        self._coordinator = coordinator
        self._worker_id = worker_id
        if settings.verbose >= 2:
            logging.getLogger("hvdray").setLevel(logging.DEBUG)
        if rank_info is not None:
            export_rank_env(rank_info, tuple(node_gpu_ids))
        if joins_running_job:
            _load_what_optimizers_import()
        membership = None
        if worker_id is not None:
            membership = _NamingMembership(coordinator, worker_id, settings.elastic_timeout + settings.timeout_s,
                                           self._took_rank)
        session.configure(
            session.JobConfig(
                rank_info=rank_info,
                settings=settings,
                secret=secret,
                store_factory=lambda prefix: CoordinatorStore(coordinator, prefix, settings.timeout_s),
                host_ip=ray.util.get_node_ip_address(),
                epoch=epoch,
                membership=membership,
            )
        )
        ray_logger.set_sink(self._send_log)
        reporting.set_sink(
            reporting.ExecutorReports(coordinator, settings.storage_path, self._track_send, self._record_origin))
        datasets.set_source(datasets.ShardSource(coordinator, settings.timeout_s))
        self._took_rank(rank_info.rank if rank_info is not None else None)
        # What this process holds now (Ray, torch, hvdray) lives as long as it does: keep it out of the
        # cyclic collector's full passes, which otherwise scan it all (over 100 ms in a worker) in the
        # middle of some training step, once enough short-lived op objects have survived into gen 2.
        # No gc.collect() first: after the imports it finds a few dozen unreachable objects, and costs
        # ~0.1 s of CPU in every worker's start.
        gc.freeze()

    def ping(self) -> bool:
        """Answered while ``run`` is busy (elastic workers are threaded actors): the driver's liveness probe."""
        return True

    def ready_after_failed_call(self) -> bool:
        """Whether this worker can take the driver's next call after one in which a rank raised: every
        engine it runs is still working (one whose ring broke keeps raising what broke it). The next
        call's generated names count from 0 on every rank (``Engine.begin_call``), whatever each rank
        submitted in the failed one."""
        from hvdray.collective import session

        return not any(engine.broken for engine in session.engines())

    def _send_log(self, record: dict[str, Any]) -> None:
        rank = int(os.environ.get("HOROVOD_RANK", "-1"))  # elastic ranks change with each epoch
        self._pending_logs.append(self._coordinator.push_log.remote(rank, record, self._record_origin()))

    def _record_origin(self) -> tuple[str, int]:
        """This process's records are numbered in the order sent (logs and reports alike): the coordinator
        keeps them in that order whatever order Ray runs its calls in."""
        return self._record_sender, next(self._record_numbers)

    def _track_send(self, ref: Any) -> None:
        self._pending_logs.append(ref)

    def _flush_logs(self) -> None:
        pending, self._pending_logs = self._pending_logs, []
        if pending:
            ray.get(pending)

    def start_executable(self, cls: Optional[type], args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        self._executable = cls(*args, **kwargs) if cls is not None else None

    def run(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any], call: int = 0) -> Any:
        """Run ``fn(*args, **kwargs)`` as executor call ``call`` (numbered by the driver alike on every rank)."""
        return self._call(call, fn, *args, **kwargs)

    def execute(self, fn: Callable[[Any], Any], call: int = 0) -> Any:
        """Run ``fn(executable)`` as executor call ``call``."""
        return self._call(call, fn, self._executable)

    def exit_process(self, patience_s: float) -> None:
        """End this worker's process as a script's process ends: the actor leaves Ray at once, then the
        interpreter waits for non-daemon threads and runs the ``atexit`` handlers and finalizers (open
        files are flushed, the engine shut down). Past ``patience_s`` (a thread that never ends, a handler
        that blocks) the process ends there and then, so that none outlives its job."""
        def overdue() -> None:
            sys.stderr.write(f"hvdray worker: still exiting after {patience_s} s (a non-daemon thread or an atexit "
                             "handler that blocks); ended\n")
            sys.stderr.flush()
            os._exit(1)

        timer = threading.Timer(patience_s, overdue)
        timer.daemon = True
        timer.start()
        ray.actor.exit_actor()

    def _call(self, call: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run the user's function; when it returns or raises, every rank hears of it (see
        ``session.end_call``), so that no peer waits forever for an op this rank will never submit."""
        from hvdray.collective import session

        session.begin_call(call)
        how = "raised"
        try:
            try:
                result = fn(*args, **kwargs)
            except SystemExit as exc:
                # In a Ray actor, SystemExit would end the worker's process, and run() would report a
                # worker that "died unexpectedly". As in a script: sys.exit() or sys.exit(0) ends this
                # rank's function (its result None), any other code is this rank's failure, named so.
                # Ray's own exits (ray.actor.exit_actor(), its SIGTERM handler) mark theirs and go on.
                if hasattr(exc, "ray_terminate_msg"):
                    raise
                if exc.code not in (None, 0):
                    raise RuntimeError(
                        f"{getattr(fn, '__qualname__', 'the function')} called sys.exit({exc.code!r}) on rank "
                        f"{self._rank}"
                    ) from exc
                result = None
            how = "returned"
            return result
        finally:
            session.end_call(how)
            self._flush_logs()


class _NamingMembership(CoordinatorMembership):
    """An elastic worker's membership that renames the worker (its log prefix) at every new epoch."""

    def __init__(self, coordinator: Any, worker_id: str, wait_limit_s: float,
                 took_rank: Callable[[Optional[int]], None]) -> None:
        super().__init__(coordinator, worker_id, wait_limit_s)
        self._took_rank = took_rank

    def next_epoch(self, left_epoch: int) -> tuple[int, RankInfo]:
        epoch, info = super().next_epoch(left_epoch)
        self._took_rank(info.rank)
        return epoch, info


def _load_what_optimizers_import() -> None:
    """Import ``torch._dynamo`` now, in the start of an elastic worker that joins a running job.

    The first ``torch.optim`` optimizer a process builds imports it (``Optimizer.add_param_group`` is
    wrapped to keep TorchDynamo out): 1.3 s of CPU on the development machine, a minute when starved.
    A worker joining a running job would pay that inside the user's function, after its epoch formed,
    while every other member waits for it in the state sync. Here it is paid before the worker counts
    as started, while the members go on training. The first epoch's workers do not: the user's function
    pays it on all of them at once, right after the epoch forms, and a start that does more is not
    faster. (A thread could import it meanwhile, but a user's import racing it could deadlock.)"""
    import torch._dynamo  # noqa: F401
