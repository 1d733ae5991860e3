"""``RayExecutor``: the driver-side facade with horovod.ray's signatures.

It owns the job's placement group (fixed jobs) or coordinator (elastic jobs) and hands the workers to
a :class:`~hvdray.driver.worker_group.WorkerGroup`. ``run`` sends a function to every worker and
returns the results in rank order; a failing rank makes ``run`` raise that rank's exception at once,
and the worker group is stopped and a new one started before the next call.

With ``min_workers``/``max_workers`` the job is elastic: no placement group, workers follow the
cluster's free slots, and each ``run`` is driven by :class:`hvdray.driver.controller.ElasticDriver`.
``ElasticRayExecutor`` is the same thing under horovod.ray's elastic names.
"""

from __future__ import annotations

import logging
import sys
import threading
import uuid
import weakref
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator, NoReturn, Optional, Sequence

import ray

from hvdray.driver.arguments import (
    check_call_arguments,
    check_callable,
    check_callbacks,
    check_executor_arguments,
    check_start_arguments,
    check_storage_arguments,
)
from hvdray.driver.cluster import init_ray
from hvdray.driver.controller import ElasticDriver
from hvdray.driver.coordinator_host import HOSTED_BY_WORKER_UP_TO, JobCoordinator, start_job_coordinator
from hvdray.driver.datasets import DatasetSplitter, check_data_config, check_datasets
from hvdray.driver.discovery import HostDiscovery, RayNodeDiscovery
from hvdray.driver.failures import WorkerLostError
from hvdray.driver.held import Held, abandon, current_ray_session, held_attribute, release_abandoned
from hvdray.driver.payload import PayloadGuard, call_pieces
from hvdray.driver.placement import Placement, plan_placement
from hvdray.driver.policies import ElasticLimits, FailurePolicy
from hvdray.driver.records import Callback
from hvdray.driver.results import RunResults
from hvdray.driver.worker_group import GroupState, WorkerGroup, actor_name
from hvdray.settings import Settings, make_settings

if TYPE_CHECKING:
    from ray.data import Dataset
    from ray.train import CheckpointConfig, DataConfig, Result

log = logging.getLogger(__name__)

#: after a call in which a rank raised, how long the next call waits for the other workers to end theirs (their
#: ops the raising rank never submitted fail at once) before it starts new workers instead
_FAILED_CALL_SETTLE_S = 5.0

__all__ = ["ElasticRayExecutor", "RayExecutor", "WorkerLostError"]


class _CallTurns:
    """One call to an executor at a time (``start``, ``run``, ``execute``, ``execute_single``, the sending
    of ``run_remote``): a call from a second thread waits for the one in progress to end, so every worker
    receives the calls in the same order (a worker runs its calls one by one, in the order they arrive; two
    threads sending to the ranks in turn would give them different orders, and their collectives would pair
    one call's ops with another's). A call made by the thread whose call is in progress (a callback that
    calls the executor) would wait for itself: it is refused."""

    def __init__(self, executor_id: str) -> None:
        self._executor_id = executor_id
        self._lock = threading.Lock()
        self._holder: Optional[int] = None  # the thread whose call is in progress

    def __reduce__(self) -> tuple[type, tuple[str]]:
        """A copy takes no turn of the original's (an executor pickled into a closure stays picklable)."""
        return _CallTurns, (self._executor_id,)

    @contextmanager
    def turn(self, what: str) -> Iterator[None]:
        if self._holder == threading.get_ident():
            raise RuntimeError(
                f"{what} was called on hvdray executor {self._executor_id} from within a call of its own on the "
                "same thread (a callback?): it would wait for that call, which waits for the callback"
            )
        with self._lock:
            self._holder = threading.get_ident()
            try:
                yield
            finally:
                self._holder = None


class RayExecutor:
    """Run Horovod-style distributed functions on Ray actors (see the README for a walk-through)."""

    # what the executor holds in the cluster, kept in its Held record (released even if it is dropped)
    _placement = held_attribute("placement")
    _group = held_attribute("group")
    _coordinator = held_attribute("coordinator")
    _driver = held_attribute("driver")

    @classmethod
    def create_settings(
        cls,
        timeout_s: Optional[float] = None,
        ssh_identity_file: Optional[str] = None,
        ssh_str: Optional[str] = None,
        placement_group_timeout_s: Optional[float] = None,
        nics: Optional[Sequence[str]] = None,
        **kwargs: Any,
    ) -> Settings:
        """Validated settings (horovod.ray's signature); any other field of :class:`hvdray.settings.Settings`
        may be passed too. Arguments left at ``None`` take their ``HVDRAY_*`` variable or the default."""
        given = dict(
            timeout_s=timeout_s,
            ssh_identity_file=ssh_identity_file,
            ssh_str=ssh_str,
            placement_group_timeout_s=placement_group_timeout_s,
            nics=nics,
        )
        return make_settings(**{k: v for k, v in given.items() if v is not None}, **kwargs)

    def __init__(
        self,
        settings: Optional[Settings] = None,
        num_workers: Optional[int] = None,
        num_hosts: Optional[int] = None,
        num_workers_per_host: int = 1,
        cpus_per_worker: float = 1,
        use_gpu: bool = False,
        gpus_per_worker: Optional[float] = None,
        use_current_placement_group: bool = True,
        min_workers: Optional[int] = None,
        max_workers: Optional[int] = None,
        reset_limit: Optional[int] = None,
        cooldown_range: Optional[tuple[float, float]] = None,
        elastic_timeout: float = 600,
        override_discovery: bool = True,
        storage_path: Optional[str] = None,
        checkpoint_config: Optional["CheckpointConfig"] = None,
        dataset_config: Optional["DataConfig"] = None,
    ) -> None:
        if settings is None:
            settings = make_settings()
        elastic = check_executor_arguments(
            settings, num_workers, num_hosts, num_workers_per_host, cpus_per_worker, use_gpu, gpus_per_worker,
            min_workers, max_workers, reset_limit, cooldown_range, elastic_timeout, override_discovery,
        )
        storage = check_storage_arguments(settings, storage_path, checkpoint_config)
        check_data_config(dataset_config)
        self._dataset_config = dataset_config  # how run(datasets=...) splits them (Ray Train's DataConfig)
        if storage != settings.storage_path:  # made absolute: the workers' working directory is not ours
            settings = settings.model_copy(update={"storage_path": storage})
        self.settings = settings
        self._checkpoint_config = checkpoint_config
        self._results: Optional[RunResults] = None  # the latest finished call's reports
        self._collecting: Optional[RunResults] = None  # the reports of the call in progress
        self.use_gpu = bool(use_gpu)
        gpus = (gpus_per_worker if gpus_per_worker is not None else 1) if use_gpu else 0
        self._cpus_per_worker, self._gpus_per_worker = cpus_per_worker, gpus
        self._limits: Optional[ElasticLimits] = None
        self._plan = None
        if elastic:
            self._limits = ElasticLimits(
                min_workers=min_workers or 1,
                max_workers=max_workers if max_workers is not None else sys.maxsize,
                reset_limit=reset_limit,
                cooldown_range=tuple(cooldown_range) if cooldown_range is not None else None,
                elastic_timeout=float(elastic_timeout),
            )
            self._override_discovery = override_discovery
            # the blacklist outlives each run: a node that failed stays avoided for its cooldown
            self._failure_policy = FailurePolicy(self._limits.reset_limit, self._limits.cooldown_range)
            self.num_workers = self._limits.min_workers
        else:
            self.num_workers = num_workers if num_workers is not None else num_hosts * num_workers_per_host
            self._plan = plan_placement(num_workers, num_hosts, num_workers_per_host, cpus_per_worker, gpus)
        self._use_current_pg = use_current_placement_group
        self._id = uuid.uuid4().hex[:8]
        self._held = Held(self._id)  # placement, group, coordinator, driver: the attributes of those names
        weakref.finalize(self, abandon, self._held)
        self._executable: tuple[Optional[type], list[Any], dict[str, Any]] = (None, [], {})
        self._extra_env: dict[str, str] = {}
        self._state = "new"  # new -> started -> shut down
        self._turns = _CallTurns(self._id)
        self._constructor_env: Optional[dict[str, str]] = None  # ElasticRayExecutor's env_vars
        self._payload = PayloadGuard(settings.payload_warning_mb)
        if settings.verbose >= 2:
            logging.getLogger("hvdray").setLevel(logging.DEBUG)

    @property
    def result(self) -> Optional["Result"]:
        """The latest ``run``'s (or ``execute``'s) ``ray.train.Result``, None before the first: rank 0's
        ``hvdray.report`` metrics (``metrics``, ``metrics_dataframe``), its checkpoints under storage_path
        (``checkpoint``, ``best_checkpoints``), ``error`` (what ``run`` raised, if it failed), ``path``
        and ``return_value`` (rank 0's return value)."""
        return self._results.result() if self._results is not None else None

    # -- lifecycle -----------------------------------------------------------------------------
    def start(
        self,
        executable_cls: Optional[type] = None,
        executable_args: Optional[Sequence[Any]] = None,
        executable_kwargs: Optional[dict[str, Any]] = None,
        extra_env_vars: Optional[dict[str, str]] = None,
    ) -> None:
        """Reserve the placement group and start one worker per rank (building ``executable_cls`` on each).
        A start that fails or is interrupted (Ctrl-C) releases what it reserved and started, and leaves the
        executor as it was before: ``start()`` can be called again."""
        executable = (executable_cls, list(executable_args or ()), dict(executable_kwargs or {}))
        with self._turns.turn("start()"):
            self._start(executable, extra_env_vars)

    def _start(
        self, executable: tuple[Optional[type], list[Any], dict[str, Any]], extra_env_vars: Optional[dict[str, str]]
    ) -> None:
        """``start()`` in its turn: ``executable`` is ``(executable_cls, executable_args, executable_kwargs)``."""
        executable_cls, executable_args, executable_kwargs = executable
        if self._state == "shut down":
            raise RuntimeError("this executor was shut down; create a new RayExecutor")
        if self._state != "new":
            raise RuntimeError("start() was already called on this executor")
        check_start_arguments(executable_cls, extra_env_vars)
        if self._limits is not None and executable_cls is not None:
            raise ValueError("executable_cls is not supported by elastic executors: workers come and go; use run()")
        self._executable = executable
        self._payload.check("start()", self.num_workers, None, [("executable_cls", executable_cls)]
                            + call_pieces(executable_args, executable_kwargs, prefix="executable_"), stacklevel=4)
        self._extra_env = dict(extra_env_vars or {})
        if not ray.is_initialized():
            init_ray()  # $RAY_ADDRESS (ray job submit) or a new local instance, never a stranger's cluster
        release_abandoned()
        try:
            if self._limits is not None:
                self._coordinator = self._start_coordinator()  # the elastic driver starts workers in each run()
            else:
                self._placement = Placement(self._plan, self.settings.placement_group_timeout_s,
                                            self._use_current_pg, name=actor_name(self._id, "pg"))
                self._start_group()
        except BaseException:
            self._held.release()
            raise
        self._held.ray_session = current_ray_session()
        self._state = "started"

    def _runtime_env(self) -> Optional[dict[str, Any]]:
        return {"env_vars": self._extra_env} if self._extra_env else None

    def _start_coordinator(self) -> JobCoordinator:
        return start_job_coordinator(self.settings.timeout_s, self.settings.placement_group_timeout_s)

    def _start_group(self) -> None:
        """A new worker group with its own coordinator (in its first worker, for a job of at most
        ``HOSTED_BY_WORKER_UP_TO`` workers); if it cannot start, it stops what it started."""
        coordinator = self._start_coordinator() if self.num_workers > HOSTED_BY_WORKER_UP_TO else None
        self._group = WorkerGroup(self._id, self.settings, coordinator, self._runtime_env(),
                                  elastic=False, owns_coordinator=True)
        self._group.start_fixed(self._placement.actor_options, self.num_workers, self._executable,
                                self._placement.check_feasible)

    def shutdown(self) -> None:
        """End the workers (idle ones exit on their own first: see ``WorkerGroup.stop``), drop the job from the
        coordinator and release the placement group; safe to call twice. A ``run`` waiting meanwhile (in
        another thread: a notebook's background cell, a Tune trial being stopped) raises saying so."""
        self._state = "shut down"  # first: a run that sees its workers go reads it
        self._held.release()

    def __enter__(self) -> "RayExecutor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def _ensure_started(self) -> None:
        """Start a new executor on first use, and anew where the Ray session it started in has ended (its
        workers went with it); refuse one that was shut down."""
        if self._state == "started" and self._held.in_ended_session():
            log.warning("hvdray executor %s: the Ray session it was started in has ended (ray.shutdown(), or Ray "
                        "started again); starting its workers anew", self._id)
            self._held.forget()
            self._state = "new"
            self._start(self._executable, self._extra_env or None)
        elif self._state == "new":
            self._start((None, [], {}), self._constructor_env)
        elif self._state == "shut down":
            raise RuntimeError("this executor was shut down; create a new RayExecutor")

    def _ready_group(self) -> WorkerGroup:
        """The running worker group: started on first use, and anew after an interrupt, a lost worker, or
        a call in which a rank raised and the others did not end their call within
        :data:`_FAILED_CALL_SETTLE_S` (or one of them has a broken ring)."""
        if self._limits is not None:
            raise RuntimeError("elastic executors have no fixed workers: use run(), not run_remote/execute")
        self._ensure_started()
        group = self._group
        if group is not None and group.failed_call and not group.settle_failed_call(_FAILED_CALL_SETTLE_S):
            group.stop()
        if self._group is None or self._group.state is GroupState.STOPPED:
            self._start_group()
        assert self._group is not None
        return self._group

    # -- running functions ---------------------------------------------------------------------
    def run(
        self,
        fn: Callable[..., Any],
        args: Optional[Sequence[Any]] = None,
        kwargs: Optional[dict[str, Any]] = None,
        callbacks: Optional[Sequence[Callback]] = None,
        datasets: Optional[dict[str, "Dataset"]] = None,
    ) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` on every worker; results in rank order.

        Elastic executors run ``fn`` on as many workers as the cluster offers (between min_workers and
        max_workers), re-forming the ring as nodes come and go; callbacks also receive every driver
        transition as ``{"event": "elastic", ...}``. ``datasets`` (name -> ``ray.data.Dataset``) are
        split into one equal shard per rank, which ``hvdray.get_dataset_shard(name)`` returns in ``fn``."""
        check_callbacks(callbacks)
        splitter = self._splitter(datasets)
        with self._turns.turn("run()"):
            if self._limits is not None:
                return self._run_elastic(fn, args, kwargs, callbacks, splitter)
            return self._gather(self._send_run(fn, args, kwargs, "run()", splitter), callbacks)

    def _splitter(self, datasets: Optional[dict[str, "Dataset"]]) -> Optional[DatasetSplitter]:
        checked = check_datasets(datasets)
        return DatasetSplitter(checked, self._dataset_config) if checked is not None else None

    def _run_elastic(
        self,
        fn: Callable[..., Any],
        args: Optional[Sequence[Any]],
        kwargs: Optional[dict[str, Any]],
        callbacks: Optional[Sequence[Callback]],
        datasets: Optional[DatasetSplitter],
    ) -> list[Any]:
        check_callable(fn)
        self._payload.check("run()", self.num_workers, fn, call_pieces(args, kwargs))
        self._ensure_started()
        assert self._limits is not None and self._coordinator is not None
        # the workers wait for their epochs up to elastic_timeout; discovery stays with the driver
        worker_settings = self.settings.model_copy(
            update={"discovery": None, "elastic_timeout": self._limits.elastic_timeout}
        )
        group = WorkerGroup(self._id, worker_settings, self._coordinator, self._runtime_env(), elastic=True,
                            owns_coordinator=False)
        driver = ElasticDriver(
            group=group,
            limits=self._limits,
            settings=self.settings,
            discovery=self._discovery(),
            cpus_per_worker=self._cpus_per_worker,
            gpus_per_worker=self._gpus_per_worker,
            failure_policy=self._failure_policy,
        )
        self._driver = driver
        self._collect_results(group)
        try:
            values = driver.run(fn, list(args or ()), dict(kwargs or {}), list(callbacks or ()), datasets)
        except BaseException as exc:
            self._raise_failed_call(group, exc)
        finally:
            self._driver = None
        self._finish_results(group, values=values)
        return values

    def _collect_results(self, group: WorkerGroup) -> None:
        """Before a call is sent: its reports go to a new result, its checkpoints are numbered on from
        those already in storage_path."""
        results = RunResults(self.settings.storage_path, self._checkpoint_config)
        if self.settings.storage_path is not None:
            group.ask_coordinator(group.coordinator.begin_checkpoints.remote(results.first_checkpoint()),
                                  "where checkpoints begin")
        group.records.on_report = results.add
        self._collecting = results

    def _finish_results(
        self, group: WorkerGroup, values: Optional[list[Any]] = None, error: Optional[BaseException] = None
    ) -> None:
        """The call ended (with ``values`` in rank order, or ``error``): its result becomes ``self.result``."""
        group.records.on_report = None
        results, self._collecting = self._collecting, None
        if results is not None:
            results.finish(error=error, return_value=values[0] if values else None)
            self._results = results

    def _discovery(self) -> HostDiscovery:
        if not self._override_discovery:
            return self.settings.discovery

        def held() -> dict[str, int]:
            return self._driver.held() if self._driver is not None else {}

        return RayNodeDiscovery(self._cpus_per_worker, self._gpus_per_worker, held)

    def run_remote(
        self,
        fn: Callable[..., Any],
        args: Optional[Sequence[Any]] = None,
        kwargs: Optional[dict[str, Any]] = None,
        datasets: Optional[dict[str, "Dataset"]] = None,
    ) -> list[ray.ObjectRef]:
        """Like ``run`` but returns the ObjectRefs (rank order) without waiting; the workers run the call
        after those sent before it, and before any sent after it."""
        splitter = self._splitter(datasets)
        with self._turns.turn("run_remote()"):
            return self._send_run(fn, args, kwargs, "run_remote()", splitter)

    def _send_run(
        self, fn: Callable[..., Any], args: Optional[Sequence[Any]], kwargs: Optional[dict[str, Any]], what: str,
        datasets: Optional[DatasetSplitter],
    ) -> list[ray.ObjectRef]:
        check_call_arguments(fn, args, kwargs)
        group = self._ready_group()
        workers = group.ranked()
        self._payload.check(what, len(workers), fn, call_pieces(args, kwargs))  # the caller's caller: the user
        call = self._group_call(datasets)
        return group.send(workers, lambda actor: actor.run.remote(fn, list(args or ()), dict(kwargs or {}), call))

    def execute(self, fn: Callable[[Any], Any], callbacks: Optional[Sequence[Callback]] = None) -> list[Any]:
        """Call ``fn(executable)`` on every worker's executable instance; results in rank order."""
        check_callable(fn)
        check_callbacks(callbacks)
        with self._turns.turn("execute()"):
            group = self._ready_group()
            workers = group.ranked()
            self._payload.check("execute()", len(workers), fn, stacklevel=3)
            call = self._group_call()
            return self._gather(group.send(workers, lambda actor: actor.execute.remote(fn, call)), callbacks)

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """Call ``fn(executable)`` on rank 0 only and return its result."""
        check_callable(fn)
        with self._turns.turn("execute_single()"):
            group = self._ready_group()
            self._payload.check("execute_single()", 1, fn, stacklevel=3)
            call = self._group_call()
            return self._gather(group.send(group.ranked()[:1], lambda actor: actor.execute.remote(fn, call)),
                                None)[0]

    def _group_call(self, datasets: Optional[DatasetSplitter] = None) -> int:
        """A new call to the workers: numbered, its reports collected (``run``, ``execute`` and
        ``execute_single`` wait for them and set ``self.result``; ``run_remote`` leaves them to the next),
        ``datasets`` split over the ranks."""
        group = self._group
        assert group is not None, "the workers were started"
        self._collect_results(group)
        return group.begin_call(datasets)

    def _gather(self, calls: list[ray.ObjectRef], callbacks: Optional[Sequence[Callback]]) -> list[Any]:
        group = self._group
        assert group is not None, "the calls were sent to this executor's worker group"
        try:
            values = group.gather(calls, list(callbacks or ()))
        except BaseException as exc:
            # A lost worker stopped the group already, and a rank that raised left it to finish the call (the
            # next call checks). Anything else ends the call on the driver's side while the workers may still
            # run it, mid-collective: Ctrl-C (or a notebook's interrupt), a callback that raised, a lost
            # coordinator (the workers' rendezvous and records went with it). They are stopped; the executor
            # stays usable and its next call starts fresh workers in the same placement group.
            if group.state is not GroupState.STOPPED and not group.failed_call:
                group.stop()
                if isinstance(exc, KeyboardInterrupt):
                    log.warning("hvdray executor %s interrupted: workers stopped; the next call starts new ones",
                                self._id)
            self._raise_failed_call(group, exc)
        self._finish_results(group, values=values)
        return values

    def _raise_failed_call(self, group: WorkerGroup, exc: BaseException) -> NoReturn:
        """In the ``except`` of a failed call: record ``exc`` as the call's result and raise it, unless
        ``shutdown()`` came from another thread while the call waited, whose stopped workers would otherwise
        read as workers that died: then an error that says so."""
        if self._state != "shut down" or isinstance(exc, KeyboardInterrupt):
            self._finish_results(group, error=exc)
            raise  # the exception being handled, with its own traceback
        error = RuntimeError(
            f"hvdray executor {self._id} was shut down (executor.shutdown(), from another thread) while this "
            "call waited for its workers; they were stopped"
        )
        self._finish_results(group, error=error)
        raise error from exc


class ElasticRayExecutor(RayExecutor):
    """horovod.ray's ``ElasticRayExecutor``: an elastic :class:`RayExecutor` under Horovod's names."""

    @classmethod
    def create_settings(  # type: ignore[override]
        cls,
        min_num_proc: int = 1,
        max_num_proc: Optional[int] = None,
        reset_limit: Optional[int] = None,
        elastic_timeout: float = 600,
        timeout_s: float = 30,
        ssh_identity_file: Optional[str] = None,
        nics: Optional[Sequence[str]] = None,
        min_np: Optional[int] = None,
        max_np: Optional[int] = None,
        **kwargs: Any,
    ) -> Settings:
        """Validated settings carrying the elastic limits (``min_np``/``max_np`` are Horovod's older names)."""
        return make_settings(
            elastic_min_workers=min_np if min_np is not None else min_num_proc,
            elastic_max_workers=max_np if max_np is not None else max_num_proc,
            elastic_reset_limit=reset_limit,
            elastic_timeout=elastic_timeout,
            timeout_s=timeout_s,
            ssh_identity_file=ssh_identity_file,
            nics=list(nics) if nics is not None else None,
            **kwargs,
        )

    def __init__(
        self,
        settings: Settings,
        use_gpu: bool = False,
        cpus_per_slot: float = 1,
        gpus_per_slot: Optional[float] = None,
        env_vars: Optional[dict[str, str]] = None,
        override_discovery: bool = True,
        cooldown_range: Optional[tuple[float, float]] = None,
        storage_path: Optional[str] = None,
        checkpoint_config: Optional["CheckpointConfig"] = None,
    ) -> None:
        if not isinstance(settings, Settings):
            raise TypeError(
                f"settings must come from ElasticRayExecutor.create_settings(), got {type(settings).__name__}"
            )
        super().__init__(
            settings,
            cpus_per_worker=cpus_per_slot,
            use_gpu=use_gpu,
            gpus_per_worker=gpus_per_slot,
            min_workers=settings.elastic_min_workers or 1,
            max_workers=settings.elastic_max_workers,
            reset_limit=settings.elastic_reset_limit,
            cooldown_range=cooldown_range,
            elastic_timeout=settings.elastic_timeout,
            override_discovery=override_discovery,
            storage_path=storage_path,
            checkpoint_config=checkpoint_config,
        )
        self._constructor_env = env_vars

    def start(self) -> None:  # type: ignore[override]
        """Start the job's coordinator; workers start inside ``run``."""
        super().start(extra_env_vars=self._constructor_env)

    def run(  # type: ignore[override]
        self, worker_fn: Callable[[], Any], callbacks: Optional[Sequence[Callback]] = None,
        datasets: Optional[dict[str, "Dataset"]] = None,
    ) -> list[Any]:
        """Run ``worker_fn()`` elastically; results of the final workers in rank order. ``datasets`` are
        split anew over the workers of every membership epoch (``hvdray.get_dataset_shard``)."""
        return super().run(worker_fn, callbacks=callbacks, datasets=datasets)
